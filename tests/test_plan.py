"""The plan contract against plain-Python references of its documented rules."""

import copy
import inspect
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mstar.engine.resources.kv import indptrs as indptrs_mod
from mstar.engine.resources.kv import plan as plan_mod
from mstar.engine.resources.kv.plan import (
    HostLens,
    KVPlanOutput,
    KVPlanOutputs,
    PagedIndptrs,
    PinnedIndexRing,
    SequenceView,
    build_paged_indptrs,
    context_only_views,
    group_by_plan_label,
)
from mstar.engine.resources.step import Segment

# --- references: the rules, row by row, in plain Python -------------------------


def ref_indptrs(views, page_size):
    qo, kvp, idx, last, lens = [0], [0], [], [], []
    for v in views:
        qo.append(qo[-1] + v.to_compute)
        kvp.append(kvp[-1] + len(v.page_idxs))
        idx.extend(int(p) for p in v.page_idxs)
        lp = (v.start + v.length) % page_size or page_size
        last.append(lp)
        lens.append(max(len(v.page_idxs) - 1, 0) * page_size + lp)
    return qo, kvp, idx, last, lens


def ref_context_only(views, spans, page_size):
    out = []
    for v, q in zip(views, spans):
        stored = v.length - v.to_compute
        keep = 0 if stored == 0 else -(-(v.start + stored) // page_size)
        out.append((v.request_id, v.label, list(v.page_idxs[:keep]), stored, q, v.start))
    return out


# --- strategies --------------------------------------------------------------------------


@st.composite
def views_and_page_size(draw, min_rows=0, max_rows=8):
    page_size = draw(st.integers(1, 17))
    n = draw(st.integers(min_rows, max_rows))
    as_array = draw(st.booleans())
    views = []
    for i in range(n):
        length = draw(st.integers(0, 60))
        to_compute = draw(st.integers(0, length))
        start = draw(st.integers(0, 2 * page_size))
        need = -(-(start + length) // page_size)
        pages = draw(st.lists(st.integers(0, 10_000), min_size=need, max_size=need + 2))
        if as_array:
            pages = np.array(pages, dtype=np.int32)
        views.append(
            SequenceView(f"r{i}", draw(st.sampled_from("ab")), pages, length, to_compute, start, i)
        )
    return views, page_size


def assert_matches_reference(built, views, page_size):
    qo, kvp, idx, last, lens = ref_indptrs(views, page_size)
    for name, want in zip(PagedIndptrs._fields, (qo, kvp, idx, last, lens)):
        got = getattr(built, name)
        assert got.dtype == torch.int32, name
        assert got.device.type == "cpu", name
        assert got.tolist() == want, name
    assert isinstance(built.kv_lens, HostLens)


# --- the spec's surface ------------------------------------------------------------------


def test_spec_signatures():
    def params(obj):
        return [(p.name, p.default) for p in inspect.signature(obj).parameters.values()]

    empty = inspect.Parameter.empty
    assert params(build_paged_indptrs) == [
        ("segments", empty),
        ("page_size", empty),
        ("ring", None),
    ]
    assert params(context_only_views) == [
        ("views", empty),
        ("query_spans", empty),
        ("page_size", empty),
    ]
    assert params(group_by_plan_label) == [("segments", empty), ("combined_labels", empty)]
    assert params(KVPlanOutput) == [
        ("cpu_indptrs", empty),
        ("views", None),
        ("cuda_indptrs", None),
        ("decode_pages", None),
        ("decode_offsets", None),
        ("rows", None),
        ("view_builder", None),
    ]
    assert params(KVPlanOutputs) == [("mapping", None), ("pre_forks", ()), ("post_forks", ())]
    assert params(PinnedIndexRing) == [("numel", 4096), ("depth", 2), ("per_plan", 4)]
    assert SequenceView._fields == (
        "request_id",
        "label",
        "page_idxs",
        "length",
        "to_compute",
        "start",
        "generation",
    )
    assert SequenceView._field_defaults == {"start": 0, "generation": 0}
    assert PagedIndptrs._fields == (
        "qo_indptr",
        "paged_kv_indptr",
        "paged_kv_indices",
        "paged_kv_last_page_len",
        "kv_lens",
    )
    assert PagedIndptrs._field_defaults == {"kv_lens": None}
    assert Segment._fields == ("request_id", "label", "span", "tokens")
    assert issubclass(HostLens, torch.Tensor) and issubclass(KVPlanOutputs, dict)
    assert set(plan_mod.__all__) == {
        "build_paged_indptrs",
        "context_only_views",
        "group_by_plan_label",
        "HostLens",
        "KVPlanOutput",
        "KVPlanOutputs",
        "PagedIndptrs",
        "PinnedIndexRing",
        "SequenceView",
    }


def test_last_page_len():
    assert SequenceView("r", "a", [0, 1], 20, 1).last_page_len(16) == 4
    assert SequenceView("r", "a", [0, 1], 32, 1).last_page_len(16) == 0
    assert SequenceView("r", "a", [0, 1], 13, 1, start=3).last_page_len(16) == 0


# --- build_paged_indptrs -----------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(views_and_page_size())
def test_build_matches_reference(case):
    views, page_size = case
    assert_matches_reference(build_paged_indptrs(views, page_size), views, page_size)


@settings(max_examples=100, deadline=None)
@given(views_and_page_size(), st.integers(1, 8))
def test_build_with_ring_matches_reference(case, numel):
    views, page_size = case
    ring = PinnedIndexRing(numel=numel, depth=2, per_plan=1)
    ring.begin_plan()
    built = build_paged_indptrs(views, page_size, ring)
    assert_matches_reference(built, views, page_size)
    ptrs = [t.data_ptr() for t in built[:4] if t.numel()]
    assert len(set(ptrs)) == len(ptrs)


def test_build_empty():
    built = build_paged_indptrs([], 16)
    assert built.qo_indptr.tolist() == [0] and built.paged_kv_indptr.tolist() == [0]
    for t in (built.paged_kv_indices, built.paged_kv_last_page_len, built.kv_lens):
        assert t.numel() == 0 and t.dtype == torch.int32
    assert isinstance(built.kv_lens, HostLens)


CORRUPTIONS = [  # what _corrupt breaks
    "negative length",
    "negative to_compute",
    "to_compute > length",
    "too few pages",
    "negative page",
    "float length",
    "bool to_compute",
    "float start",
    "int64 page beyond int32",
    "float page array",
    "str page",
]


def _corrupt(views, i, how, page_size):
    v = views[i]
    covering = -(-(v.start + max(v.length, 1)) // page_size)
    return {
        "negative length": lambda: v._replace(length=-1, to_compute=0),
        "negative to_compute": lambda: v._replace(to_compute=-1),
        "to_compute > length": lambda: v._replace(to_compute=v.length + 1),
        "too few pages": lambda: v._replace(length=v.length + 1, page_idxs=v.page_idxs[:0]),
        "negative page": lambda: v._replace(
            length=max(v.length, 1), page_idxs=[3] * covering + [-1]
        ),
        "float length": lambda: v._replace(length=float(v.length)),
        "bool to_compute": lambda: v._replace(length=max(v.length, 1), to_compute=True),
        "float start": lambda: v._replace(start=np.float64(v.start)),
        "int64 page beyond int32": lambda: v._replace(
            length=max(v.length, 1), page_idxs=[np.int64(2**32 + 1)] * covering
        ),
        "float page array": lambda: v._replace(
            length=max(v.length, 1), page_idxs=np.ones(covering, dtype=np.float64)
        ),
        "str page": lambda: v._replace(length=max(v.length, 1), page_idxs=["1"] * covering),
    }[how]()


@settings(max_examples=100, deadline=None)
@given(
    views_and_page_size(min_rows=1),
    st.data(),
    st.sampled_from(CORRUPTIONS),
)
def test_build_rejects_invalid_view_naming_the_row(case, data, how):
    views, page_size = case
    i = data.draw(st.integers(0, len(views) - 1))
    bad = list(views)
    bad[i] = _corrupt(views, i, how, page_size)
    with pytest.raises(ValueError) as err:
        build_paged_indptrs(bad, page_size)
    assert repr(bad[i].request_id) in str(err.value)
    assert repr(bad[i].label) in str(err.value)


@pytest.mark.parametrize("page_size", [0, -3, 2.5, 4.0, True, 2**31, "16", None])
def test_build_rejects_page_size(page_size):
    with pytest.raises(ValueError, match="page_size"):
        build_paged_indptrs([SequenceView("r", "a", [0], 1, 1)], page_size)
    with pytest.raises(ValueError, match="page_size"):
        context_only_views([SequenceView("r", "a", [0], 1, 1)], [1], page_size)


GOOD = SequenceView("ok", "main", [7, 8], 20, 4, 0)


def _row_with(**fields):
    return SequenceView("bad", "lab", **{"page_idxs": [1], "length": 3, "to_compute": 1, **fields})


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        # page ids: never truncated or wrapped
        ({"page_idxs": [1.5]}, "integer page indices"),
        ({"page_idxs": [1.0]}, "integer page indices"),
        ({"page_idxs": ["1"]}, "integer page indices"),
        ({"page_idxs": [None]}, "integer page indices"),
        ({"page_idxs": [True]}, "integer page indices"),
        ({"page_idxs": [np.float64(1.0)]}, "integer page indices"),
        ({"page_idxs": [2**31]}, "in \\[0, 2\\*\\*31\\)"),
        ({"page_idxs": [2**32 + 1]}, "2\\*\\*31"),
        ({"page_idxs": [2**70]}, "2\\*\\*31"),
        ({"page_idxs": [np.int64(2**32 + 1)]}, "2\\*\\*31"),
        ({"page_idxs": [np.uint64(2**63)]}, "2\\*\\*31"),
        ({"page_idxs": np.array([1.0])}, "1-D integer array"),
        ({"page_idxs": np.array([True])}, "1-D integer array"),
        ({"page_idxs": np.array([[1]])}, "1-D integer array"),
        ({"page_idxs": np.array([2**32 + 1])}, "2\\*\\*31"),
        ({"page_idxs": np.array([-(2**32) + 5])}, "2\\*\\*31"),  # would wrap to 5
        ({"page_idxs": np.array([2**63], dtype=np.uint64)}, "2\\*\\*31"),
        ({"page_idxs": np.array([-1], dtype=np.int32)}, "2\\*\\*31"),
        # lengths, counts, starts
        ({"length": 1.5}, "length an integer"),
        ({"length": 2.0}, "length an integer"),
        ({"length": np.float64(2.0)}, "length an integer"),
        ({"length": "3"}, "length an integer"),
        ({"length": None}, "length an integer"),
        ({"length": True}, "length an integer"),
        ({"length": np.bool_(True)}, "length an integer"),
        ({"length": 2**31, "page_idxs": [0] * 2**12, "to_compute": 0}, "length in"),
        ({"length": np.int64(2**32 + 1)}, "length in"),
        ({"length": np.uint64(2**63)}, "length in"),
        ({"to_compute": 0.5}, "to_compute an integer"),
        ({"start": 1.0}, "start an integer"),
        ({"start": -(2**40)}, "start in"),
    ],
)
@pytest.mark.parametrize("where", [0, 1])
@pytest.mark.parametrize("with_ring", [False, True])
def test_build_refuses_bad_values_naming_the_row(fields, says, where, with_ring):
    bad = _row_with(**fields)
    views = [GOOD, bad] if where else [bad, GOOD]
    ring = PinnedIndexRing(numel=8, depth=2, per_plan=1) if with_ring else None
    with pytest.raises(ValueError, match=says) as err:
        build_paged_indptrs(views, 2**19, ring)
    assert f"request 'bad', label 'lab' (row {where})" in str(err.value)
    if ring is not None:
        assert ring._used == 0  # nothing taken


def test_build_refuses_int32_overflow_of_sums_naming_the_row():
    big = 2**31 - 1
    ps = 2**30
    rows = [SequenceView("a", "x", [0, 1], big, big), SequenceView("b", "y", [2, 3], big, 5)]
    with pytest.raises(ValueError, match="total < 2\\*\\*31") as err:
        build_paged_indptrs(rows, ps)
    assert "request 'b', label 'y' (row 1)" in str(err.value)
    wide = [SequenceView("a", "x", [0, 1], 5, 1), SequenceView("c", "z", [0, 1, 2], 5, 1)]
    with pytest.raises(ValueError, match="kv_lens < 2") as err:  # 2**31 + 4
        build_paged_indptrs(wide, ps)
    assert "request 'c', label 'z'" in str(err.value)
    end = [SequenceView("d", "w", [0, 1], big, 1, start=5)]  # start + length > int32
    with pytest.raises(ValueError, match="request 'd', label 'w'"):
        build_paged_indptrs(end, ps)


@pytest.mark.parametrize("before", [0, indptrs_mod._FEW_ROWS])  # either builder
def test_build_refuses_sums_of_numpy_integers_beyond_int32_naming_the_row(before):
    big, ps = np.int32(2**31 - 1), 2**30
    ok = [SequenceView("ok", "x", [0], 1, 0)] * before
    kv = SequenceView("k", "z", [0, 1], np.int32(0), np.int32(0), np.int32(0))  # kv_lens 2**31
    with pytest.raises(ValueError, match="kv_lens < 2") as err:
        build_paged_indptrs([*ok, kv], ps)
    assert f"request 'k', label 'z' (row {before})" in str(err.value)
    total = [SequenceView("a", "x", [0, 1], big, big), SequenceView("b", "y", [2, 3], big, big)]
    with pytest.raises(ValueError, match="total < 2\\*\\*31") as err:
        build_paged_indptrs([*ok, *total], ps)
    assert f"request 'b', label 'y' (row {before + 1})" in str(err.value)


def test_build_accepts_numpy_integers_lists_and_mixed_rows():
    views = [
        SequenceView("a", "x", [np.int64(3), np.uint8(4)], np.int64(20), np.int32(2), np.uint16(0)),
        SequenceView("b", "x", np.array([5], dtype=np.uint64), 3, 1),
        SequenceView("c", "x", np.array([6, 2**31 - 1], dtype=np.int64), 17, 1),
        SequenceView("d", "x", [9], 1, 1, start=15),
        SequenceView("e", "x", np.array([], dtype=np.int16), 0, 0),
    ]
    assert_matches_reference(build_paged_indptrs(views, np.int64(16)), views, 16)
    arrays = [v._replace(page_idxs=np.asarray(v.page_idxs, dtype=np.int64)) for v in views]
    assert_matches_reference(build_paged_indptrs(arrays, 16), arrays, 16)
    mixed = [arrays[0], views[3], arrays[1]]  # arrays first, then a list
    assert_matches_reference(build_paged_indptrs(mixed, 16), mixed, 16)
    big = [SequenceView("f", "x", [0, 1], 2**31 - 1, 2**31 - 1)]  # the int32 edge: fine
    assert_matches_reference(build_paged_indptrs(big, 2**30), big, 2**30)


# --- HostLens, PagedIndptrs --------------------------------------------------------------


def test_host_lens_iterates_numpy_scalars_and_is_a_tensor_otherwise():
    lens = build_paged_indptrs(
        [SequenceView("a", "x", [0, 1], 20, 1), SequenceView("b", "x", [2], 5, 1)], 16
    ).kv_lens
    items = list(lens)
    assert all(type(x) is np.int32 for x in items)
    assert max(lens).item() == 20 and isinstance(max(lens).item(), int)
    assert lens.cpu().tolist() == [20, 5]
    assert lens.min().item() == 5 and len(lens) == 2 and lens[1].item() == 5
    dst = torch.zeros(2, dtype=torch.int32)
    dst.copy_(lens)
    assert dst.tolist() == [20, 5]
    assert type(lens + 1) is torch.Tensor
    assert copy.deepcopy(lens).tolist() == [20, 5] and type(copy.deepcopy(lens)) is HostLens
    assert pickle.loads(pickle.dumps(lens)).tolist() == [20, 5]
    assert HostLens([3, 4]).tolist() == [3, 4] and HostLens([3]).dtype == torch.int32


def test_paged_indptrs_to_device_and_kwargs():
    built = build_paged_indptrs([SequenceView("a", "x", [0, 1], 20, 4)], 16)
    moved = built.to_device(torch.device("cpu"))
    assert moved.kv_lens is built.kv_lens
    assert all(torch.equal(a, b) for a, b in zip(moved[:4], built[:4]))
    kwargs = built.to_kwargs_dict()
    assert list(kwargs) == list(PagedIndptrs._fields)
    assert kwargs["paged_kv_indices"] is built.paged_kv_indices


# --- context_only_views ------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(views_and_page_size(), st.data())
def test_context_only_views_matches_reference(case, data):
    views, page_size = case
    spans = [data.draw(st.integers(0, 5)) for _ in views]
    got = context_only_views(views, spans, page_size)
    want = ref_context_only(views, spans, page_size)
    assert [
        (v.request_id, v.label, list(v.page_idxs), v.length, v.to_compute, v.start) for v in got
    ] == want
    assert [v.generation for v in got] == [v.generation for v in views]


def test_context_only_views_rejects_mismatched_spans():
    with pytest.raises(ValueError, match="one query span per view"):
        context_only_views([SequenceView("r", "a", [0], 3, 1)], [1, 2], 16)


# --- KVPlanOutput, KVPlanOutputs ---------------------------------------------------------


def _decode_views():
    return [SequenceView("r1", "main", [0], 5, 1), SequenceView("r2", "main", [1, 2], 17, 1)]


def test_plan_output_builds_views_lazily_and_once():
    views = _decode_views()
    indptrs = build_paged_indptrs(views, 16)
    calls = []

    def builder():
        calls.append(1)
        return views

    out = KVPlanOutput(indptrs, view_builder=builder)
    assert out.get_total_len() == 2 and out.is_decode
    assert calls == []
    assert out.views is views and out.views is views
    assert out.rows == [("r1", "main"), ("r2", "main")]
    assert calls == [1]


def test_plan_output_rows_given_do_not_build_views():
    indptrs = build_paged_indptrs(_decode_views(), 16)

    def builder():
        raise AssertionError("views built")

    out = KVPlanOutput(indptrs, rows=[("r1", "main"), ("r2", "main")], view_builder=builder)
    assert out.rows == [("r1", "main"), ("r2", "main")]


def test_plan_output_is_decode():
    prefill = [SequenceView("r1", "main", [0], 5, 5), SequenceView("r2", "main", [1], 1, 1)]
    out = KVPlanOutput(build_paged_indptrs(prefill, 16), views=prefill)
    assert not out.is_decode and out.get_total_len() == 6
    pages, offsets = np.array([0, 1]), np.array([4, 0])
    out = KVPlanOutput(
        build_paged_indptrs(prefill, 16), views=prefill, decode_pages=pages, decode_offsets=offsets
    )
    assert out.is_decode and out.decode_pages is pages and out.decode_offsets is offsets
    # a zero-token row is not a decode row even when the total equals the row count
    odd = [SequenceView("r1", "main", [0], 5, 2), SequenceView("r2", "main", [1], 1, 0)]
    assert not KVPlanOutput(build_paged_indptrs(odd, 16), views=odd).is_decode


def test_plan_output_needs_views_or_builder():
    with pytest.raises(ValueError, match="view_builder"):
        KVPlanOutput(build_paged_indptrs([], 16))


def test_plan_outputs_keep_forks_through_pickle_and_copy():
    views = _decode_views()
    out = KVPlanOutput(build_paged_indptrs(views, 16), views=views)
    outs = KVPlanOutputs({"main": out}, pre_forks=(("main", "s1"),), post_forks=(("main", "s2"),))
    assert outs["main"] is out and list(outs) == ["main"] and isinstance(outs, dict)
    for clone in (pickle.loads(pickle.dumps(outs)), copy.copy(outs)):
        assert type(clone) is KVPlanOutputs
        assert clone.pre_forks == (("main", "s1"),) and clone.post_forks == (("main", "s2"),)
        assert list(clone) == ["main"] and clone["main"].rows == [("r1", "main"), ("r2", "main")]
    assert not hasattr(outs, "__dict__")
    empty = KVPlanOutputs()
    assert empty == {} and empty.pre_forks == () and empty.post_forks == ()
