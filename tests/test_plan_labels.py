"""group_by_plan_label against a plain-Python reference of its rules: combined
labels first, then standalone ones by first appearance."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mstar.engine.resources.kv.plan import group_by_plan_label
from mstar.engine.resources.step import Segment


def ref_group(segments, combined):
    out = {}
    sources = [label for key in combined for label in key]
    for key, plan_label in combined.items():
        out[plan_label] = [s for label in key for s in segments if s.label == label]
    for s in segments:
        if s.label not in sources:
            out.setdefault(s.label, []).append(s)
    return out


@st.composite
def step_and_combined(draw):
    labels = draw(st.lists(st.sampled_from("abcdef"), min_size=1, max_size=6, unique=True))
    segments = []
    for r in range(draw(st.integers(1, 5))):
        for label in draw(st.lists(st.sampled_from(labels), unique=True)):
            segments.append(Segment(f"r{r}", label, draw(st.integers(0, 4))))
    draw(st.randoms()).shuffle(segments)
    present = list(dict.fromkeys(s.label for s in segments))
    pool = list(present)
    combined = {}
    while len(pool) >= 1 and draw(st.booleans()):
        k = draw(st.integers(1, len(pool)))
        key = tuple(pool[:k])
        pool = pool[k:]
        combined[key] = "+".join(key)
    return tuple(segments), combined


@settings(max_examples=200, deadline=None)
@given(step_and_combined())
def test_group_by_plan_label_matches_reference(case):
    segments, combined = case
    got = group_by_plan_label(segments, combined)
    want = ref_group(segments, combined)
    assert list(got) == list(want)
    assert got == want


def test_group_combined_first_then_standalone_by_first_appearance():
    segs = (
        Segment("r1", "x", 1),
        Segment("r1", "u", 1),
        Segment("r2", "c", 1),
        Segment("r2", "u", 1),
    )
    got = group_by_plan_label(segs, {("c", "u"): "cfg"})
    assert list(got) == ["cfg", "x"]
    assert got["cfg"] == [segs[2], segs[1], segs[3]]


def test_group_missing_combined_source_is_key_error_naming_it():
    with pytest.raises(KeyError) as err:
        group_by_plan_label((Segment("r", "cond", 1),), {("cond", "uncond"): "cfg"})
    assert "'uncond'" in str(err.value) and "('cond', 'uncond')" in str(err.value)


@pytest.mark.parametrize(
    "combined",
    [{("a",): "p", ("a", "b"): "q"}, {("a",): "p", ("b",): "p"}, {("a",): "b"}],
)
def test_group_rejects_ambiguous_combined_labels(combined):
    with pytest.raises(ValueError, match="expected"):
        group_by_plan_label((Segment("r", "a", 1), Segment("r", "b", 1)), combined)
