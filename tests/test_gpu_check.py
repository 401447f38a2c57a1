"""scripts/gpu_check.sh without a GPU: its dry run offline (pip may reach no
index), and the driver's bounds: a stage past its timeout is killed with its
children, results are counted from what finished, the overall budget caps
every stage."""

from __future__ import annotations

import importlib.util
import io
import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CUDA_STAGES = ("paged_attention", "ring", "engine", "compiled", "tensor_parallel", "flashinfer")


@pytest.fixture(scope="module")
def gpu_check():
    """scripts/gpu_check.py as a module."""
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def _wheel(folder: Path) -> Path:
    """A minimal pure-Python wheel (one empty module)."""
    folder.mkdir()
    path = folder / "gpu_check_probe-0.0.0-py3-none-any.whl"
    info = "gpu_check_probe-0.0.0.dist-info"
    files = {
        "gpu_check_probe.py": "",
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: gpu-check-probe\nVersion: 0.0.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w") as whl:
        for name, text in files.items():
            whl.writestr(name, text)
    return path


def test_dry_run_offline_installs_the_wheels_and_says_what_it_skips(tmp_path):
    wheels = tmp_path / "wheels"
    _wheel(wheels)
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path / "out"), PIP_NO_INDEX="1")
    env["PIP_INDEX_URL"] = "http://127.0.0.1:9/simple"  # nothing listens: a fetch would fail
    t0 = time.monotonic()
    done = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run", "--wheels", str(wheels)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert lines[-1] == "8 passed, 0 failed"  # wheels, 6 collected stages, timing on the CPU
    assert any(ln.startswith("ok wheels: gpu_check_probe-0.0.0") for ln in lines)
    for stage in CUDA_STAGES:
        (skip,) = [ln for ln in lines if ln.startswith(f"skip {stage}: ")]
        assert re.search(r"; its \d+ tests collect$", skip)
    assert not [ln for ln in lines if ln.startswith("FAIL")]
    out = tmp_path / "out"
    assert "plan layer µs" in (out / "gpu_timing.txt").read_text()
    assert "8 passed, 0 failed" in (out / "gpu_check.log").read_text()
    print(f"dry run: {time.monotonic() - t0:.0f} s")


def test_a_stage_past_its_timeout_is_killed_with_its_children(gpu_check):
    child = "import subprocess; p = subprocess.Popen(['sleep', '60']); print(p.pid, flush=True); p.wait()"
    t0 = time.monotonic()
    outcome = gpu_check.run([sys.executable, "-c", child], 3, io.StringIO(), dict(os.environ))
    assert outcome.returncode is None and time.monotonic() - t0 < 20
    status = Path(f"/proc/{int(outcome.output.split()[0])}/status")
    for _ in range(100):  # SIGKILL lands within moments
        if not status.exists() or "zombie" in status.read_text():
            break
        time.sleep(0.05)
    else:
        pytest.fail("the stage's child outlived its timeout")


def test_results_are_counted_from_what_finished(gpu_check):
    output = "\n".join(
        [
            "tests/test_a.py::test_x[1] PASSED    [ 25%]",
            "tests/test_a.py::test_x[2] FAILED    [ 50%]",
            "tests/test_a.py::test_y SKIPPED (needs CUDA)    [ 75%]",
            "tests/test_a.py::test_z ERROR",
            "FAILED tests/test_a.py::test_x[2] - AssertionError",
            "tests/test_a.py::test_w ",  # cut at the timeout while running
        ]
    )
    assert gpu_check.count_results(output) == {
        "PASSED": ["tests/test_a.py::test_x[1]"],
        "FAILED": ["tests/test_a.py::test_x[2]"],
        "SKIPPED": ["tests/test_a.py::test_y"],
        "ERROR": ["tests/test_a.py::test_z"],
    }


def test_a_test_stage_counts_passes_failures_and_its_timeout(gpu_check, tmp_path):
    path = tmp_path / "test_stage.py"
    path.write_text(
        "import time\n"
        "def test_pass(): pass\n"
        "def test_fail(): assert False\n"
        "def test_hang(): time.sleep(120)\n"
    )
    check = gpu_check.Check(tmp_path / "out", budget_s=300, dry_run=False)
    assert check.tests("stage", str(path), limit=20)  # one passed: true though cut
    assert (check.passed, check.failed) == (1, 2)  # test_fail, and the cut
    log = (tmp_path / "out" / "gpu_check.log").read_text()
    assert "FAIL stage: cut at its timeout" in log


def test_the_overall_budget_caps_every_stage(gpu_check, tmp_path, capsys):
    check = gpu_check.Check(tmp_path, budget_s=2, dry_run=False)
    assert check.timeout(90) <= 2
    assert check.stage("late", [sys.executable, "-c", "pass"], 90) is None
    assert "skip late: the overall time budget is spent" in capsys.readouterr().out
