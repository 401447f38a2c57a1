"""The host CPU as speed decisions and benchmark tables name it: its model, the
vector flags that matter here, and its family (AVX2, AVX-512, AVX512-BF16, AMX).

Read from ``/proc/cpuinfo`` (Linux) and torch's own capability probe
(``torch.backends.cpu.get_cpu_capability()``, what its kernels dispatch to);
on a system without ``/proc/cpuinfo`` the model is ``platform.processor()``
and the flags are those torch reports.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["CpuInfo", "cpu_info", "family_of"]

# The flags that decide a path here, in the order a table prints them.
FLAGS_OF_INTEREST = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


@dataclass(frozen=True)
class CpuInfo:
    """The CPU's ``model`` name, its ``flags`` among ``FLAGS_OF_INTEREST``,
    its ``family`` (``family_of``), torch's kernel ``capability``, the
    ``threads`` torch runs on, and ``cpuid``: its family and model numbers
    ("family 25 model 17"; "" when not read), which tell the core apart
    where a VM names it only "AMD EPYC"."""

    model: str
    flags: tuple[str, ...]
    family: str
    capability: str
    threads: int
    cpuid: str = ""

    def describe(self) -> str:
        """One line for a table's caption or a start-up line."""
        model = f"{self.model}, {self.cpuid}" if self.cpuid else self.model
        return (
            f"{model} ({self.family}; flags {' '.join(self.flags) or 'none'};"
            f" torch {self.capability}, {self.threads} threads)"
        )


def family_of(flags: set[str] | frozenset[str]) -> str:
    """The CPU family a path is chosen for: ``AMX`` (bfloat16 tiles),
    ``AVX512-BF16``, ``AVX-512``, ``AVX2`` or ``baseline``."""
    if "amx_bf16" in flags or "amx_tile" in flags:
        return "AMX"
    if "avx512_bf16" in flags:
        return "AVX512-BF16"
    if "avx512f" in flags:
        return "AVX-512"
    if "avx2" in flags:
        return "AVX2"
    return "baseline"


def cpu_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> CpuInfo:
    """The host CPU (``cpuinfo``: the file to read, for tests)."""
    model, cpuid, flags = _read_cpuinfo(cpuinfo)
    capability = torch.backends.cpu.get_cpu_capability()
    if not flags:  # no /proc/cpuinfo: what torch dispatches to
        flags = _flags_from_capability(capability)
    shown = tuple(f for f in FLAGS_OF_INTEREST if f in flags)
    return CpuInfo(
        model or platform.processor() or "unknown CPU",
        shown,
        family_of(flags),
        capability,
        torch.get_num_threads(),
        cpuid,
    )


def _read_cpuinfo(path: Path) -> tuple[str, str, frozenset[str]]:
    """The first model name, "family F model M" and flags the file gives (""
    and none when unreadable)."""
    try:
        text = path.read_text()
    except OSError:
        return "", "", frozenset()
    wanted = ("model name", "cpu family", "model", "flags")
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
        if all(k in fields for k in wanted):
            break
    family, number = fields.get("cpu family", ""), fields.get("model", "")
    cpuid = f"family {family} model {number}" if family and number else ""
    return fields.get("model name", ""), cpuid, frozenset(fields.get("flags", "").split())


def _flags_from_capability(capability: str) -> frozenset[str]:
    """Flags implied by torch's capability name (``AVX2``, ``AVX512``, ...)."""
    flags = {"avx", "avx2", "fma"} if capability.startswith(("AVX2", "AVX512")) else set()
    if capability.startswith("AVX512"):
        flags.add("avx512f")
    if torch.cpu._is_avx512_bf16_supported():
        flags.add("avx512_bf16")
    if torch.cpu._is_amx_tile_supported():
        flags.add("amx_tile")
    return frozenset(flags)
