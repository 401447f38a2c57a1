"""build_paged_indptrs' two builders (a few rows on Python ints, more through
numpy) give the same arrays and the same errors."""

import numpy as np
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from test_plan import CORRUPTIONS, _corrupt, assert_matches_reference

from mstar.engine.resources.kv import indptrs as indptrs_mod
from mstar.engine.resources.kv.plan import (
    HostLens,
    PagedIndptrs,
    SequenceView,
    build_paged_indptrs,
)

# --- the two builders: row by row (few rows) and column-wise (numpy) ----------------------

INT32_MAX = 2**31 - 1
BUILDERS = (indptrs_mod._arrays_by_row, indptrs_mod._arrays_by_column)


@st.composite
def rows_either_side(draw, max_rows=indptrs_mod._FEW_ROWS + 16, sums_in_int32=True):
    """Valid views of up to ``max_rows`` rows (either side of the threshold):
    integer fields of assorted types, page ids as lists (ints or numpy
    scalars) or arrays of assorted integer dtypes, values up to the int32 edge.
    Without ``sums_in_int32`` a row's kv_lens, and the to_compute total, may
    reach 2**31 (at the larger page sizes): the views are then invalid."""
    page_size = draw(st.one_of(st.integers(1, 17), st.sampled_from([2**20, 2**30, INT32_MAX])))
    n = draw(st.integers(0, max_rows))
    pages_as = draw(st.sampled_from(["list", "int32 array", "mixed"]))
    budget = INT32_MAX if sums_in_int32 else 2**64
    rows = []
    for i in range(n):
        num_pages = draw(st.integers(0, 4))
        end = draw(st.integers(0, min(num_pages * page_size, INT32_MAX)))
        need = -(-end // page_size)
        kv_len = max(num_pages - 1, 0) * page_size + (end - 1) % page_size + 1
        if sums_in_int32 and kv_len > INT32_MAX:
            num_pages = need  # kv_lens is then end (or page_size), in range
        start = draw(st.integers(0, end))
        to_compute = draw(st.integers(0, min(end - start, budget)))
        budget -= to_compute
        ids = draw(st.lists(st.integers(0, INT32_MAX), min_size=num_pages, max_size=num_pages))
        how = pages_as if pages_as != "mixed" else draw(st.sampled_from(["list", "array"]))
        if how == "int32 array":
            ids = np.array(ids, dtype=np.int32)
        elif how == "array":
            ids = np.array(ids, dtype=draw(st.sampled_from([np.int32, np.int64, np.uint64])))
        elif draw(st.booleans()):
            ids = [np.int64(p) for p in ids]
        as_int = st.sampled_from([int, int, np.int64, np.int32, np.uint64])
        length, to_compute, start = (draw(as_int)(x) for x in (end - start, to_compute, start))
        rows.append(
            SequenceView(f"r{i}", draw(st.sampled_from("ab")), ids, length, to_compute, start)
        )
    return rows, page_size


def _plain(v):
    """``v`` with its length, to_compute and start Python ints."""
    return v._replace(length=int(v.length), to_compute=int(v.to_compute), start=int(v.start))


def _as_tensors(arrays_and_lens):
    arrays, lens = arrays_and_lens
    return [torch.from_numpy(a) for a in arrays] + [HostLens(lens)]


def assert_identical(got, want):
    for name, a, b in zip(PagedIndptrs._fields, got, want):
        assert a.dtype == b.dtype == torch.int32, name
        assert a.shape == b.shape and a.is_contiguous() and b.is_contiguous(), name
        assert a.numpy().tobytes() == b.numpy().tobytes(), name


@settings(max_examples=300, deadline=None)
@given(rows_either_side())
def test_builders_agree_byte_for_byte_on_valid_views(case):
    views, page_size = case
    by_row, by_column = (_as_tensors(build(views, page_size)) for build in BUILDERS)
    assert_identical(by_row, by_column)
    plain = [_plain(v) for v in views]
    assert_matches_reference(PagedIndptrs(*by_row[:4], HostLens(by_row[4])), plain, page_size)
    assert_identical(build_paged_indptrs(views, page_size), by_row)


def _break(views, i, how, page_size):
    """Breaks beyond ``_corrupt``'s (same signature)."""
    v = views[i]
    covering = -(-(v.start + max(v.length, 1)) // page_size)
    return {
        "length beyond int32": lambda: v._replace(length=2**31),
        "uint64 to_compute 2**63": lambda: v._replace(to_compute=np.uint64(2**63)),
        "None length": lambda: v._replace(length=None),
        "negative start": lambda: v._replace(start=-1),
        "end beyond int32": lambda: v._replace(start=INT32_MAX, length=max(v.length, 1)),
        "pages an int": lambda: v._replace(page_idxs=5),
        "2-D page array": lambda: v._replace(
            length=max(v.length, 1), page_idxs=np.zeros((covering, 1), dtype=np.int32)
        ),
        "bool page array": lambda: v._replace(
            length=max(v.length, 1), page_idxs=np.ones(covering, dtype=bool)
        ),
        "uint64 page 2**63": lambda: v._replace(
            length=max(v.length, 1), page_idxs=np.full(covering, 2**63, dtype=np.uint64)
        ),
        "page 2**31": lambda: v._replace(length=max(v.length, 1), page_idxs=[2**31] * covering),
        "bool page": lambda: v._replace(length=max(v.length, 1), page_idxs=[True] * covering),
        "to_compute total beyond int32": lambda: v._replace(  # the test appends two
            start=0,
            length=INT32_MAX,
            to_compute=INT32_MAX,
            page_idxs=[0] * -(-INT32_MAX // page_size),
        ),
        "kv_lens beyond int32": lambda: v._replace(page_idxs=list(v.page_idxs) + [0] * 3),
    }[how]()


BREAKS = [
    *CORRUPTIONS,
    "length beyond int32",
    "uint64 to_compute 2**63",
    "None length",
    "negative start",
    "end beyond int32",
    "pages an int",
    "2-D page array",
    "bool page array",
    "uint64 page 2**63",
    "page 2**31",
    "bool page",
    "to_compute total beyond int32",
    "kv_lens beyond int32",
]


@pytest.mark.parametrize("how", BREAKS)
@settings(max_examples=40, deadline=None)
@given(
    st.booleans().flatmap(lambda sums_in_int32: rows_either_side(sums_in_int32=sums_in_int32)),
    st.data(),
)
def test_builders_refuse_the_same_views_with_the_same_error(how, case, data):
    views, page_size = case
    if not views:
        views = [SequenceView("r0", "a", [1], 1, 1)]
    i = data.draw(st.integers(0, len(views) - 1))
    bad = list(views)
    if how == "to_compute total beyond int32":  # two rows of 2**31 - 1
        if page_size >= 2**20:  # else they would take 2**31 / page_size pages
            bad += [_break([_plain(views[i])], 0, how, page_size)] * 2
    else:  # the broken row starts plain
        bad[i] = (_corrupt if how in CORRUPTIONS else _break)([_plain(views[i])], 0, how, page_size)
    outcomes = []
    for build in BUILDERS:
        try:
            outcomes.append(_as_tensors(build(bad, page_size)))
        except Exception as err:  # the very error is what is compared
            outcomes.append((type(err), str(err)))
    by_row, by_column = outcomes
    if isinstance(by_row, list) and isinstance(by_column, list):
        assert_identical(by_row, by_column)  # the break left them valid (say, a spare page)
        event("both accept")
    else:
        assert by_row == by_column
        assert by_row[0] in (ValueError, TypeError)
        event(f"both refuse: {by_row[0].__name__}")


@pytest.mark.parametrize("n", [0, 1, indptrs_mod._FEW_ROWS, indptrs_mod._FEW_ROWS + 1, 80])
def test_build_takes_the_row_path_for_few_rows_only(monkeypatch, n):
    taken = []
    for name in ("_arrays_by_row", "_arrays_by_column"):
        real = getattr(indptrs_mod, name)
        monkeypatch.setattr(
            indptrs_mod, name, lambda s, p, real=real, name=name: taken.append(name) or real(s, p)
        )
    views = [SequenceView(f"r{i}", "a", [i], 3, 1) for i in range(n)]
    assert_matches_reference(build_paged_indptrs(views, 4), views, 4)
    assert taken == ["_arrays_by_row" if n <= indptrs_mod._FEW_ROWS else "_arrays_by_column"]
