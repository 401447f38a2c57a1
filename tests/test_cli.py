"""``mstar-kv demo | bench`` end to end, in a reduced size."""

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("rich")

from mstar.cli import main
from mstar.demo import Server, build_model, check, make_workload, serve


def test_demo_check_passes_under_memory_pressure(capsys):
    code = main(
        ["demo", "--check", "--quiet", "--requests", "7", "--pages", "14", "--budget", "16"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "0 failed" in out and "MISMATCH" not in out
    assert "preemptions" in out and "pages saved by sharing" in out


def test_the_checker_catches_a_wrong_token():
    reference, model = build_model(seed=0)
    requests = make_workload(4, model.config.vocab_size, seed=0)
    server = Server(model, requests, num_pages=40, page_size=8, token_budget=16)
    stats = serve(server)
    assert server.mgr.num_free_pages == 40  # finished requests gave their pages back
    assert stats.peak_shared > 0  # req2's continuations shared its prompt's pages
    results = check(reference, requests)
    assert results and all(ok for _, ok in results)
    guided = next(r for r in requests if r.uncond is not None)
    guided.outputs["cfg"][-1] ^= 1
    plain = next(r for r in requests if r.n == 1 and r.uncond is None)
    plain.outputs["main"][0] ^= 1
    failed = {what for what, ok in check(reference, requests) if not ok}
    assert failed == {f"{guided.id} (guided)", f"{plain.id}/main"}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--page-size", "0"], "--page-size must be >= 1"),
        (["--budget", "0"], "--budget must be >= 1"),
        (["--pages", "2"], "too small"),
        (["--device", "cuda:7"], "CUDA"),
    ],
)
def test_demo_rejects_impossible_options_in_one_line(capsys, args, message):
    pytest.importorskip("torch")
    import torch

    if args[0] == "--device" and torch.cuda.is_available():
        pytest.skip("CUDA is available")
    assert main(["demo", "--quiet", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_bench_prints_the_table_and_writes_json(capsys, tmp_path):
    path = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "build_paged_indptrs" in out and "decode step" in out and "max(kv_lens)" in out
    rows = json.loads(path.read_text())
    assert {"bench", "config", "ours_us", "baseline_us", "speedup", "floor_us", "params"} <= set(
        rows[0]
    )
    assert all(r["ours_us"] > 0 and r["baseline_us"] > 0 for r in rows)


def test_bench_plot(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "latency.png"
    assert main(["bench", "--quick", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
