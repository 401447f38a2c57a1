"""``mstar-kv demo | generate | bench`` end to end, in a reduced size."""

import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("rich")

from mstar.cli import main
from mstar.cli.demo import check, random_workload, serve
from mstar.engine import Engine
from mstar.models.seeded import build_model

ROOT = Path(__file__).resolve().parents[1]


def test_demo_check_passes_under_memory_pressure(capsys):
    args = ["--model", "random", "--requests", "7", "--pages", "14", "--budget", "16"]
    code = main(["demo", "--check", "--quiet", *args])
    out = capsys.readouterr().out
    assert code == 0, out
    assert " 0 failed" in out and "MISMATCH" not in out
    assert "preemptions" in out and "pages saved by sharing" in out


def test_demo_check_shows_a_bar_while_it_checks(capsys):
    args = ["--model", "random", "--requests", "3", "--pages", "14", "--budget", "16"]
    assert main(["demo", "--check", *args]) == 0
    out = capsys.readouterr().out
    done = re.search(r"checking\s.*?(\d+)/(\d+)", out)
    assert done and done.group(1) == done.group(2) != "0", out
    assert main(["demo", "--check", "--quiet", *args]) == 0
    assert "checking" not in capsys.readouterr().out


def test_help_lists_every_command_and_serve_shows_its_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "``" not in out
    for command in ("demo", "generate", "bench", "serve"):
        assert re.search(rf"^\s+{command}\s+\S", out, re.M), command
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for shown in ("(default: 8000)", "(default: 127.0.0.1)", "(default: 8388608)"):
        assert shown in out
    assert "(default: None)" not in out and "(default: False)" not in out


def test_the_demo_extra_is_enough_for_serve():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert set(extras["serve"]) <= set(extras["demo"])


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
    assert "the prompt alone" in err and "max_position_embeddings 8192" in err
    assert err.count("\n") == 1


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
    mode, err = err.split("\n", 1)  # the start-up line first: dtype and forward
    assert mode.startswith("mstar-kv: ") and " weights, forward " in mode
    assert err.startswith("(stop: 8 tokens, ") and err.endswith(" tokens/s)\n")
    default = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    system = ["--system", default, "--stop", " of France", "--max-new-tokens", "12"]
    assert main(["generate", *system, "What is the capital of France?"]) == 0
    out, err = capsys.readouterr()
    assert out == "The capital\n" and err.split("\n", 1)[1].startswith("(stop: 4 tokens")
    assert main(["generate", "--raw", "--max-new-tokens", "3", "The capital of France is"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(" Paris") and err.split("\n", 1)[1].startswith("(length: 3 tokens")


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


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompts", "3"], "--prompts and --arrivals go with --workload mixed"),
        (["--arrivals", "at-once"], "--prompts and --arrivals go with --workload mixed"),
        (["--workload", "mixed", "--prompts", "1"], "--prompts 1: expected at least 2"),
    ],
)
def test_e2e_bench_rejects_bad_options_in_one_line(capsys, args, message):
    assert main(["bench", "--e2e", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    "options, message",
    [({"prompts": 1}, "expected prompts >= 2"), ({"arrivals": "later"}, "expected arrivals")],
)
def test_mixed_bench_refuses_bad_options_before_loading(options, message):
    from mstar.bench.serving import run_mixed

    stages = []
    with pytest.raises(ValueError, match=message):
        run_mixed(quick=True, stage=stages.append, **options)
    assert stages == []


def test_mixed_jobs_vary_in_length_and_share_a_preamble(smollm2):
    """The mixed workload: seeded, limits in range, prompts of varied
    length, every other one behind the shared preamble, arrivals in order."""
    from mstar.bench.serving import mixed_jobs

    _, tokenizer = smollm2
    jobs = mixed_jobs(tokenizer, 64, (16, 256), 0, 0.3)
    assert jobs == mixed_jobs(tokenizer, 64, (16, 256), 0, 0.3)
    assert all(16 <= j.max_new_tokens <= 256 for j in jobs)
    assert len({j.max_new_tokens for j in jobs}) > 30
    assert len({len(j.prompt) for j in jobs}) > 20
    arrivals = [j.arrival for j in jobs]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0 < arrivals[-1]
    at_once = mixed_jobs(tokenizer, 64, (16, 256), 0, 0.0)
    assert {j.arrival for j in at_once} == {0.0}
    assert [(j.prompt, j.max_new_tokens) for j in at_once] == [
        (j.prompt, j.max_new_tokens) for j in jobs
    ]
    shared = [j.prompt for j in jobs[::2]]
    common = next(i for i, col in enumerate(zip(*shared)) if len(set(col)) > 1)
    assert common > 150
    assert jobs[1].prompt[:common] != shared[0][:common]


def test_every_serving_path_gives_hf_generate_tokens(smollm2):
    """Each path of the mixed bench, on three jobs (one arriving later),
    returns HF generate's tokens per job, cut to its own limit, and
    first-token times after arrival."""
    import copy

    from transformers import ContinuousBatchingConfig, GenerationConfig

    from mstar.bench.e2e import hf_one
    from mstar.bench.serving import (
        Job,
        serve_engine,
        serve_hf_batching,
        serve_padded,
    )
    from mstar.engine import Engine
    from mstar.engine.prompts import chat_prompt

    model, tokenizer = smollm2
    eos = tokenizer.eos_token_id
    config = GenerationConfig(do_sample=False, eos_token_id=eos, pad_token_id=eos)
    questions = ["What is 2 + 2?", "Name a color.", "Say hi."]
    jobs = [
        Job(chat_prompt(tokenizer, q), n, t) for q, n, t in zip(questions, (5, 2, 4), (0, 0, 0.05))
    ]
    want = []
    for job in jobs:
        limited = copy.copy(config)
        limited.max_new_tokens = job.max_new_tokens
        want.append(hf_one(model, job.prompt, limited))
    paged = copy.deepcopy(model)
    cb = ContinuousBatchingConfig(page_size=16, num_blocks=16, max_batch_tokens=64)
    for served in (
        serve_engine(lambda: Engine(paged, tokenizer, num_pages=32), jobs),
        serve_padded(model, jobs, config, 2),
        serve_hf_batching(model, jobs, config, cb),
    ):
        assert served.tokens == want
        assert all(t > 0 for t in served.ttft) and served.seconds > 0


def test_mixed_table_has_a_section_per_arrival_pattern():
    from mstar.bench.serving import format_mixed

    def row(path, seconds):
        return {
            "path": path,
            "seconds": seconds,
            "tokens": 100,
            "tokens_per_s": 100 / seconds,
            "prompts": 4,
            "exact": 4,
            "ttft_mean": 0.25,
            "ttft_p90": 0.5,
        }

    rows = [row("Engine.generate", 2.0), row("HF generate", 3.0)]
    result = {"workload": "4 prompts", "threads": 2, "patterns": {"at once": rows, "later": rows}}
    table = format_mixed(result).splitlines()
    assert table[0].startswith("4 prompts (2 threads)")
    assert table[2] == "at once" and "later" in table
    assert table[6].split()[-5:] == ["33.3", "1.50x", "4/4", "0.25", "0.50"]
    rows[1]["ratio_range"], rows[0]["ratio_range"] = (1.25, 1.75), (1.0, 1.0)
    table = format_mixed({**result, "rounds": 3}).splitlines()
    assert "best of 3 rounds in turns" in table[0]
    assert table[6].split()[-6:] == ["33.3", "1.50x", "4/4", "0.25", "0.50", "1.25-1.75x"]


def test_mixed_rows_take_each_paths_best_round_and_the_ratio_per_round():
    """A path's figures are its fastest round's; exact counts the jobs right
    in every round; the range is ours over its tokens/s round by round."""
    from mstar.bench.serving import Served, _rows

    oracle = [[1, 2], [3]]
    ours = [Served([[1, 2], [3]], [0.1, 0.2], 3.0), Served([[1, 2], [3]], [0.3, 0.4], 2.0)]
    theirs = [Served([[1, 2], [3]], [0.5, 0.5], 4.0), Served([[1, 2], [4]], [0.6, 0.6], 6.0)]
    engine, other = _rows({"ours": ours, "theirs": theirs}, oracle)
    assert (engine["seconds"], engine["ttft_mean"], engine["exact"]) == (2.0, 0.35, 2)
    assert (other["seconds"], other["ttft_mean"], other["exact"]) == (4.0, 0.5, 1)
    assert other["tokens_per_s"] == 3 / 4.0
    assert other["ratio_range"] == (4.0 / 3.0, 3.0)
    assert engine["ratio_range"] == (1.0, 1.0)
