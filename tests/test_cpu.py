"""The CPU family a speed decision names, read from /proc/cpuinfo's flags."""

from __future__ import annotations

import pytest

from mstar.cpu.info import cpu_info, family_of

ZEN3 = "fpu sse sse2 avx avx2 fma f16c"
ZEN4 = ZEN3 + " avx512f avx512bw avx512_vnni avx512_bf16"
SPR = ZEN4 + " amx_tile amx_bf16 amx_int8"


@pytest.mark.parametrize(
    ("flags", "family"),
    [(ZEN3, "AVX2"), (ZEN3 + " avx512f", "AVX-512"), (ZEN4, "AVX512-BF16"), (SPR, "AMX"),
     ("fpu sse sse2", "baseline")],
)  # fmt: skip
def test_family_of_flags(flags, family):
    assert family_of(frozenset(flags.split())) == family


def test_cpu_info_reads_the_model_and_flags(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(
        f"processor\t: 0\ncpu family\t: 25\nmodel\t\t: 1\nmodel name\t: AMD EPYC 7B13\n"
        f"flags\t\t: {ZEN3}\n\n"
        f"processor\t: 1\nmodel name\t: AMD EPYC 7B13\nflags\t\t: {ZEN3}\n"
    )
    info = cpu_info(path)
    assert info.model == "AMD EPYC 7B13"
    assert info.family == "AVX2"
    assert info.flags == ("avx", "avx2", "fma", "f16c")
    assert info.cpuid == "family 25 model 1"
    assert "AMD EPYC 7B13, family 25 model 1 (AVX2; flags avx avx2 fma f16c" in info.describe()


def test_cpu_info_without_family_numbers_names_the_model_alone(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: {ZEN3}\n")
    info = cpu_info(path)
    assert info.cpuid == ""
    assert info.describe().startswith("Some CPU (AVX2; flags avx avx2 fma f16c")


def test_cpu_info_without_cpuinfo_falls_back_to_torch(tmp_path):
    info = cpu_info(tmp_path / "missing")
    assert info.model and info.family in {"AVX2", "AVX-512", "AVX512-BF16", "AMX", "baseline"}
