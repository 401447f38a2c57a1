"""The GPU check's driver (run by scripts/gpu_check.sh): offline, bounded, in stages.

Stages, in an order that gives answers even when FlashInfer cannot build:
wheels (install ``.whl/*.whl`` with ``--no-index``), probe (torch, CUDA,
FlashInfer), paged_attention on CUDA against the CPU, the pinned index ring,
the engine on CUDA against the CPU engine, the compiled forward with CUDA
graphs against the eager engine, tensor parallelism over 2 GPUs (skipped
with fewer), FlashInfer against paged_attention (last: its JIT compiles
take the rest), then a timing table. Each stage runs in its own process
group under its own timeout, all within one overall budget; a skipped stage
says why in one line. The last line is "N passed, M failed". Everything is
logged to ``$OUT/gpu_check.log`` (``/tmp/gpu_check`` without ``$OUT``), the
table to ``gpu_timing.txt`` beside it.

``--dry-run`` runs what needs no CUDA: the wheel install, the probe, each
CUDA stage's test collection, and the timing table on the CPU at toy sizes.
Only the standard library is imported here; torch runs in the stages.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# (stage, test file, timeout in seconds on an H200; FlashInfer's JIT compiles there)
TEST_STAGES = (
    ("paged_attention", "tests/test_cuda_attention.py", 90),
    ("ring", "tests/test_cuda_ring.py", 60),
    ("engine", "tests/test_cuda_engine.py", 120),
    ("compiled", "tests/test_cuda_compiled.py", 240),  # torch.compile + CUDA graphs
    ("tensor_parallel", "tests/test_cuda_tp.py", 120),  # NCCL, TP=2: with 2 GPUs only
    # last: its JIT compiles take the rest (on an H200 in 2026-12: 11 tests in 300 s,
    # each prefill variant (window, softcap) about 2-3 min)
    ("flashinfer", "tests/test_flashinfer_cuda.py", 360),
)
WHEELS_TIMEOUT_S, PROBE_TIMEOUT_S, TIMING_TIMEOUT_S = 120, 120, 90
MAX_REASONS = 12  # per stage on stdout, so the summary stays in a short output tail
RESULT = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
PROBE = """
import json, sys
import torch
info = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
if info["cuda"]:
    info["device"] = torch.cuda.get_device_name()
    info["cuda_version"] = torch.version.cuda
    info["gpus"] = torch.cuda.device_count()
try:
    import flashinfer
    info["flashinfer"] = flashinfer.__version__
except Exception as e:
    info["flashinfer_error"] = f"{type(e).__name__}: {e}"[:300]
try:
    import transformers
    info["transformers"] = transformers.__version__
except Exception as e:
    info["transformers_error"] = f"{type(e).__name__}: {e}"[:300]
print("PROBE " + json.dumps(info))
"""


@dataclass
class Outcome:
    """What one stage's process did: its output, exit code (None: killed at
    its timeout) and seconds."""

    output: str
    returncode: int | None
    seconds: float


def run(cmd: list[str], timeout: float, log, env: dict[str, str]) -> Outcome:
    """Run ``cmd`` in its own process group, its output copied to ``log`` as
    it comes; at ``timeout`` the whole group (compilers included) is killed."""
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    lines: list[str] = []

    def pump() -> None:
        for line in proc.stdout:
            lines.append(line)
            log.write(line)
            log.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        code: int | None = proc.wait(timeout=max(timeout, 0.1))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        code = None
    reader.join(timeout=5)
    return Outcome("".join(lines), code, time.monotonic() - t0)


def count_results(output: str) -> dict[str, list[str]]:
    """Test ids by pytest ``-v`` outcome, read line by line (so a stage cut
    short at its timeout still counts what finished)."""
    found: dict[str, list[str]] = {}
    for line in output.splitlines():
        m = RESULT.match(line)
        if m:
            found.setdefault(m.group(2), []).append(m.group(1))
    return found


class Check:
    """The running tally, the log and the overall deadline."""

    def __init__(self, out_dir: Path, budget_s: float, dry_run: bool) -> None:
        self.out_dir, self.dry_run = out_dir, dry_run
        self.deadline = time.monotonic() + budget_s
        self.passed = self.failed = 0
        out_dir.mkdir(parents=True, exist_ok=True)
        self.log = (out_dir / "gpu_check.log").open("w")
        self.env = dict(os.environ)
        self.env.update(
            PYTHONUNBUFFERED="1",
            PIP_NO_INDEX="1",  # nothing is fetched, here or there
            PIP_DISABLE_PIP_VERSION_CHECK="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        )
        self._pythonpath([str(ROOT)])

    def _pythonpath(self, first: list[str]) -> None:
        rest = [p for p in self.env.get("PYTHONPATH", "").split(os.pathsep) if p]
        self.env["PYTHONPATH"] = os.pathsep.join(first + rest)

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.log.write(f"## {line}\n")
        self.log.flush()

    def skip(self, stage: str, why: str) -> None:
        self.say(f"skip {stage}: {why}")

    def fail(self, stage: str, why: str) -> None:
        self.failed += 1
        self.say(f"FAIL {stage}: {why}")

    def timeout(self, limit: float) -> float:
        """``limit``, or what is left of the overall budget if less."""
        return min(limit, self.deadline - time.monotonic())

    def stage(self, stage: str, cmd: list[str], limit: float) -> Outcome | None:
        """Run a stage's command under its timeout (None: no time left)."""
        timeout = self.timeout(limit)
        if timeout < 5:
            self.skip(stage, "the overall time budget is spent")
            return None
        shown = " ".join(a if "\n" not in a else "<script>" for a in cmd[1:])
        self.say(f"== {stage} (timeout {timeout:.0f} s): {shown}")
        return run(cmd, timeout, self.log, self.env)

    # --- the stages ----------------------------------------------------------------------

    def wheels(self, folder: Path, site: Path) -> None:
        """Install the carried wheels into ``site`` (no index, no dependencies)
        and put it on the stages' ``PYTHONPATH``."""
        wheels = sorted(folder.glob("*.whl"))
        if not wheels:
            self.skip("wheels", f"no wheels in {folder} (scripts/gpu_wheels.sh fills it)")
            return
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
        cmd += ["--no-compile", "--no-cache-dir", "--upgrade", "--target", str(site)]
        outcome = self.stage("wheels", cmd + [str(w) for w in wheels], WHEELS_TIMEOUT_S)
        if outcome is None:
            return
        if outcome.returncode != 0:
            self.fail("wheels", _why(outcome))
            return
        self.passed += 1
        self._pythonpath([str(ROOT), str(site)])
        self.say(f"ok wheels: {', '.join(w.name for w in wheels)} -> {site}")

    def probe(self) -> dict:
        """What the stages will find: torch, CUDA, FlashInfer, transformers."""
        outcome = self.stage("probe", [sys.executable, "-c", PROBE], PROBE_TIMEOUT_S)
        if outcome is None:
            return {}
        found = [ln for ln in outcome.output.splitlines() if ln.startswith("PROBE ")]
        if outcome.returncode != 0 or not found:
            self.fail("probe", _why(outcome))
            return {}
        info = json.loads(found[-1][len("PROBE ") :])
        self.say("found " + ", ".join(f"{k} {v}" for k, v in info.items()))
        return info

    def collect(self, paths: list[str]) -> dict[str, int]:
        """Collect the test files in one pytest run (a dry run's check that
        they import and find their tests); the count of tests per file."""
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q"]
        outcome = self.stage("collect", cmd + paths, 120)
        if outcome is None or outcome.returncode != 0:
            self.fail("collect", "no run" if outcome is None else _why(outcome))
            return {}
        ids = [ln.split("::")[0] for ln in outcome.output.splitlines() if "::" in ln]
        return {path: ids.count(path) for path in paths}

    def tests(self, stage: str, path: str, limit: float) -> bool:
        """One test file under pytest. True when some of its tests passed
        (also when it was cut at its timeout)."""
        base = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", path]
        outcome = self.stage(stage, [*base, "-v", "-rfEs", "--tb=short"], limit)
        if outcome is None:
            return False
        results = count_results(outcome.output)
        bad = results.get("FAILED", []) + results.get("ERROR", [])
        self.passed += len(results.get("PASSED", []))
        self.failed += len(bad)
        summary = ", ".join(f"{len(v)} {k.lower()}" for k, v in sorted(results.items()))
        self.say(f"{stage}: {summary or 'no results'} in {outcome.seconds:.1f} s")
        reasons = [  # pytest's one-line reasons (-rfEs); all of them are in the log
            ln
            for ln in outcome.output.splitlines()
            if ln.startswith(("FAILED ", "ERROR ", "SKIPPED "))
        ]
        for line in reasons[:MAX_REASONS]:
            self.say(f"  {line[:300]}")
        if len(reasons) > MAX_REASONS:
            self.say(f"  ... {len(reasons) - MAX_REASONS} more in the log")
        if outcome.returncode is None:
            self.fail(stage, f"cut at its timeout after {outcome.seconds:.0f} s")
        elif outcome.returncode not in (0, 1) or (outcome.returncode == 1 and not bad):
            self.fail(stage, f"pytest exited {outcome.returncode}: {_why(outcome)}")
        return bool(results.get("PASSED"))

    def timing(self, device: str, flashinfer: bool) -> None:
        table = self.out_dir / "gpu_timing.txt"
        cmd = [sys.executable, str(ROOT / "scripts" / "gpu_timing.py"), "--device", device]
        cmd += ["--out", str(table)] + ([] if flashinfer else ["--no-flashinfer"])
        cmd += ["--quick"] if device == "cpu" else []
        outcome = self.stage("timing", cmd, TIMING_TIMEOUT_S)
        if outcome is None:
            return
        if outcome.returncode != 0 or not table.exists():
            self.fail("timing", _why(outcome))
            return
        self.passed += 1
        print(table.read_text(), end="", flush=True)


def _why(outcome: Outcome) -> str:
    if outcome.returncode is None:
        return f"cut at its timeout after {outcome.seconds:.0f} s"
    tail = [ln.strip() for ln in outcome.output.splitlines() if ln.strip()][-3:]
    return f"exit {outcome.returncode}: " + " | ".join(tail)[-400:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="only what needs no CUDA")
    parser.add_argument("--wheels", type=Path, default=ROOT / ".whl", help="carried wheels")
    parser.add_argument("--budget", type=float, default=540.0, help="seconds for the whole run")
    args = parser.parse_args(argv)
    out_dir = Path(os.environ.get("OUT") or "/tmp/gpu_check")
    check = Check(out_dir, args.budget, args.dry_run)
    with tempfile.TemporaryDirectory(prefix="mstar-gpu-site-") as site:
        check.wheels(args.wheels, Path(site))
        info = check.probe()
        cuda = bool(info.get("cuda"))
        if not info:
            no_cuda: str | None = "the probe failed"
        elif not cuda:
            no_cuda = f"no CUDA device (torch {info.get('torch')})"
        else:
            no_cuda = "--dry-run" if args.dry_run else None
        collected = {}
        if args.dry_run and info:
            collected = check.collect([path for _, path, _ in TEST_STAGES])
        ok = dict.fromkeys((stage for stage, _, _ in TEST_STAGES), False)
        for stage, path, limit in TEST_STAGES:
            reason = no_cuda
            if stage == "flashinfer" and reason is None and "flashinfer" not in info:
                reason = f"flashinfer does not import ({info.get('flashinfer_error')})"
            if stage == "tensor_parallel" and reason is None and info.get("gpus", 0) < 2:
                reason = f"TP=2 needs 2 GPUs, this machine has {info.get('gpus')}"
            if reason is None:
                ok[stage] = check.tests(stage, path, limit)
            elif collected.get(path):
                check.passed += 1
                check.skip(stage, f"{reason}; its {collected[path]} tests collect")
            elif args.dry_run and collected:
                check.fail(stage, f"no tests collect from {path}")
            else:
                check.skip(stage, reason)
        if cuda and not args.dry_run:  # FlashInfer timed where its (decode) kernels built
            check.timing("cuda", ok["flashinfer"])
        elif info:
            check.timing("cpu", False)
    check.say(f"logs: {out_dir}")
    check.say(f"{check.passed} passed, {check.failed} failed")
    check.log.close()
    return 1 if check.failed else 0


if __name__ == "__main__":
    sys.exit(main())
