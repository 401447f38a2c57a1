"""``mstar-kv demo | generate | bench`` end to end, in a reduced size."""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("rich")

from mstar.cli import main
from mstar.demo import build_model, check, random_workload, serve
from mstar.engine import Engine

ROOT = Path(__file__).resolve().parents[1]


def test_demo_check_passes_under_memory_pressure(capsys):
    args = ["--model", "random", "--requests", "7", "--pages", "14", "--budget", "16"]
    code = main(["demo", "--check", "--quiet", *args])
    out = capsys.readouterr().out
    assert code == 0, out
    assert " 0 failed" in out and "MISMATCH" not in out
    assert "preemptions" in out and "pages saved by sharing" in out


def test_the_checker_catches_a_wrong_token():
    reference, model = build_model(seed=0)
    workload = random_workload(model.config.vocab_size, 4, seed=0)
    engine = Engine(model, num_pages=40, page_size=8, token_budget=16)
    done = serve(engine, workload)
    assert engine.mgr.num_free_pages == 40  # finished requests gave their pages back
    assert engine.stats.peak_shared > 0  # req2's samples shared its prompt's pages
    results = check(reference, workload, done, engine.eos_token_ids)
    assert len(results) == 3 + workload[2].params.n and all(ok for _, ok in results)
    for rid, index in (("req1", 0), ("req2", 1), ("req3", 0)):  # guided, sampled, greedy
        done[rid].outputs[index].token_ids[-1] ^= 1
    done["req0"].outputs[0].finish_reason = "stop"  # right tokens, wrong reason
    failed = {what for what, ok in check(reference, workload, done, engine.eos_token_ids) if not ok}
    assert failed == {"req0/0", "req1/0", "req2/1", "req3/0"}


def test_the_checker_knows_eos():
    reference, model = build_model(seed=0)
    workload = random_workload(model.config.vocab_size, 1, seed=0)
    engine = Engine(model, num_pages=40, page_size=8)
    tokens = serve(engine, workload)["req0"].outputs[0].token_ids
    eos = {tokens[1]}
    stopped = Engine(build_model(seed=0)[1], num_pages=40, page_size=8)
    stopped.eos_token_ids = frozenset(eos)
    done = serve(stopped, workload)
    assert done["req0"].outputs[0].token_ids == tokens[: tokens.index(tokens[1]) + 1]
    assert all(ok for _, ok in check(reference, workload, done, eos))
    assert not all(ok for _, ok in check(reference, workload, done, set()))
    unstopped = [replace(workload[0], params=replace(workload[0].params, ignore_eos=True))]
    assert not all(ok for _, ok in check(reference, unstopped, done, eos))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--page-size", "0"], "--page-size must be >= 1"),
        (["--budget", "0"], "--budget must be >= 1"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--pages", "2"], "too small"),
        (["--device", "cuda:7"], "CUDA"),
    ],
)
def test_demo_rejects_impossible_options_in_one_line(capsys, args, message):
    import torch

    if args[0] == "--device" and torch.cuda.is_available():
        pytest.skip("CUDA is available")
    assert main(["demo", "--quiet", "--model", "random", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/nonexistent/model"], "--model /nonexistent/model"),
        (["--temperature", "-1"], "temperature"),
        (["--temperature", "nan"], "expected temperature finite"),
        (["-n", "0"], "expected n >= 1"),
        (["--raw", "--system", "Be brief."], "--system is a chat message"),
    ],
)
def test_generate_rejects_bad_options_in_one_line(capsys, args, message):
    assert main(["generate", "hello", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def run_cli(*args: str | bytes) -> subprocess.CompletedProcess:
    """``mstar-kv ARGS`` in a fresh interpreter running this checkout."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE"}
    command = [sys.executable, "-m", "mstar.cli", *args]
    return subprocess.run(command, capture_output=True, env=env, cwd=ROOT, timeout=600)


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", ""], "expected a non-empty prompt"),
        (["generate", "hi", "--device", "foo"], "--device foo: expected a device"),
        (["generate", "hi", "--model", "EMPTY"], "expected a model folder (with config.json)"),
        (["demo", "--model", "random", "--page-size", "100000000"], "fits the free memory"),
    ],
)
def test_cli_mistakes_exit_2_with_one_line(capsys, tmp_path, args, message):
    assert main([str(tmp_path) if a == "EMPTY" else a for a in args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_cli_refuses_a_prompt_longer_than_the_model(smollm2, capsys):
    assert main(["generate", "--raw", "word " * 9000]) == 2
    err = capsys.readouterr().err
    assert "exceeds the model's max_position_embeddings 8192" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", b"caf\xe9"], "the prompt is not valid UTF-8"),  # argv as the OS passes it
        (["generate", "hi", "--max-new-tokens", "2.5"], "invalid int value: '2.5'"),
    ],
)
def test_cli_mistakes_in_a_real_process_print_no_traceback(args, message):
    done = run_cli(*args)
    err = done.stderr.decode()
    assert done.returncode == 2, err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_generate_streams_a_chat_answer_on_smollm2(smollm2, capsys):
    args = ["--max-new-tokens", "12", "What is the capital of France?"]  # chat by default
    assert main(["generate", *args]) == 0
    out, err = capsys.readouterr()
    assert out == "The capital of France is Paris.\n"
    assert err.startswith("(stop: 8 tokens, ") and err.endswith(" tokens/s)\n")
    default = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    system = ["--system", default, "--stop", " of France", "--max-new-tokens", "12"]
    assert main(["generate", *system, "What is the capital of France?"]) == 0
    out, err = capsys.readouterr()
    assert out == "The capital\n" and err.startswith("(stop: 4 tokens")
    assert main(["generate", "--raw", "--max-new-tokens", "3", "The capital of France is"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(" Paris") and err.startswith("(length: 3 tokens")


def test_demo_on_smollm2_checks_against_hf_generate(smollm2, capsys):
    args = ["--requests", "3", "--max-new-tokens", "8", "--pages", "8", "--quiet"]
    assert main(["demo", "--check", *args]) == 0
    out = capsys.readouterr().out
    assert "capital of France" in out and "guided" in out and "n=3" in out
    assert "5 passed, 0 failed" in out


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


def test_e2e_table_compares_every_path_with_ours():
    from mstar.bench.e2e import format_e2e

    def row(path, seconds, exact):
        return {"path": path, "seconds": seconds, "tokens": 100, "prompts": 4, "exact": exact}

    rows = [row("Engine.generate", 2.0, 4), row("HF generate", 4.0, 3)]
    for r in rows:
        r["tokens_per_s"] = r["tokens"] / r["seconds"]
    rows[0]["plan_share"] = 0.012
    rows[0]["prompt_tokens_computed"] = 120
    table = format_e2e({"workload": "4 prompts", "threads": 2, "rows": rows}).splitlines()
    assert table[0].startswith("4 prompts (2 threads)")
    assert table[3].split()[-5:] == ["50.0", "1.00x", "4/4", "1.2%", "120"]
    assert table[4].split()[-3:] == ["25.0", "2.00x", "3/4"]
