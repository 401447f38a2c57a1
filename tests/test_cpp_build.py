"""Building a C++ extension at first use (``mstar.cpu.build``): a
source and the headers it includes, the build named by all of them."""

from __future__ import annotations

import pytest
import torch

from mstar.cpu import build as cpp_build

SOURCE = """
#include <ATen/ATen.h>
#include <torch/library.h>
#include "value.h"

at::Tensor plus(const at::Tensor& x) { return x + VALUE; }

TORCH_LIBRARY(NAMESPACE, m) { m.def("plus(Tensor x) -> Tensor"); }
TORCH_LIBRARY_IMPL(NAMESPACE, CPU, m) { m.impl("plus", &plus); }
"""


def test_a_changed_header_is_a_new_build(tmp_path, monkeypatch):
    """One source text, two versions of the header it includes: two builds,
    each loaded with its own header (a build named by the source alone would
    load the first again for the second)."""
    monkeypatch.setenv("MSTAR_KV_CACHE", str(tmp_path))
    names = []
    for namespace, value in (("mstar_build_a", 1), ("mstar_build_b", 2)):
        header = f"#define VALUE {value}\n#define NAMESPACE {namespace}\n"
        try:
            names.append(cpp_build.build("plus", SOURCE, "t", headers={"value.h": header}))
        except Exception as err:  # no compiler here: nothing to check
            pytest.skip(f"no build: {type(err).__name__}")
        assert getattr(torch.ops, namespace).plus(torch.zeros(2)).tolist() == [value, value]
        assert (tmp_path / "t" / names[-1] / "value.h").read_text() == header
    assert names[0] != names[1]


def test_a_killed_builds_lock_is_removed_with_a_warning(tmp_path, monkeypatch):
    """A build killed mid-way leaves torch's lock file; the next build would
    wait on it forever. One older than ``STALE_LOCK_S`` is removed, with a
    warning, and the build goes on; a fresh one (a build running now) stays."""
    import os
    import time

    monkeypatch.setenv("MSTAR_KV_CACHE", str(tmp_path))
    lock = tmp_path / "lock"
    lock.touch()
    cpp_build._clear_stale_lock(lock)
    assert lock.exists()  # a build holds it now
    old = time.time() - cpp_build.STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    with pytest.warns(UserWarning, match="build lock"):
        cpp_build._clear_stale_lock(lock)
    assert not lock.exists()
    cpp_build._clear_stale_lock(lock)  # none: nothing to do
