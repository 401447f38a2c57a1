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
