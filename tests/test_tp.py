"""Tensor parallelism on the CPU: 2 gloo ranks against 1, on a tiny seeded
Llama (8 heads, 4 KV heads) saved to a folder. Ranks take seconds to start,
so one TP engine serves the tests that leave it running."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from mstar.cli import main
from mstar.engine import Engine, SamplingParams, StepFailed
from mstar.engine.resources.step import KVStep, Segment
from mstar.models.tp import TensorParallelUnsupported, WorkerFailed

OPTIONS = {"num_pages": 24, "page_size": 4, "token_budget": 16}
ROOT = Path(__file__).resolve().parent.parent


def tiny_llama(kv_heads: int = 4, heads: int = 8):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128, hidden_size=heads * 8, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=8,
        max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def engines(folder):
    """(TP=1, TP=2) engines on the same weights and options."""
    one = Engine.from_pretrained(folder, **OPTIONS)
    with Engine.from_pretrained(folder, tensor_parallel_size=2, **OPTIONS) as two:
        yield one, two
    assert not any(_alive(pid) for pid in two.tp.pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split()[2] != "Z"  # a zombie is gone


def prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 128, (n,), generator=g).tolist() for n in (9, 23, 30)]


def test_two_ranks_give_the_logits_of_one(engines):
    one, two = engines
    assert (one.cache.num_kv_heads, two.cache.num_kv_heads) == (4, 2)  # each rank its share
    tokens = prompts()
    steps = [
        (Segment("a", "main", 7, tuple(tokens[0][:7])), Segment("b", "main", 11, tuple(tokens[1][:11]))),
        (Segment("a", "main", 2, tuple(tokens[0][7:9])), Segment("b", "main", 1, (tokens[1][11],))),
        (Segment("a", "main", 1, (5,)), Segment("b", "main", 1, (6,))),
    ]  # fmt: skip
    try:
        for segments in steps:
            ids = torch.tensor([t for s in segments for t in s.tokens])
            logits = []
            for eng in engines:
                step = KVStep(segments)
                eng.mgr.admit(step)
                plan = eng.mgr.plan(step)["main"]
                logits.append(eng._forward_step(eng.model, ids, plan, eng.cache))
                eng.mgr.commit(step)
            assert logits[0].shape == (len(ids), 128)
            torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-5)
    finally:
        for eng in engines:
            for rid in ("a", "b"):
                if eng.mgr.labels(rid):
                    eng.mgr.release(rid)


def test_greedy_tokens_equal_over_chunks_forks_and_preemption(engines):
    one, two = engines
    params = [SamplingParams(max_new_tokens=12), SamplingParams(max_new_tokens=10, n=2),
              SamplingParams(max_new_tokens=14)]  # fmt: skip
    want = [[o.token_ids for o in c.outputs] for c in one.generate(prompts(), params)]
    before = two.stats.preemptions
    got = [[o.token_ids for o in c.outputs] for c in two.generate(prompts(), params)]
    assert got == want
    assert two.stats.preemptions > before  # the pool of 24 pages of 4 is too small for all
    assert two.stats.prefill_tokens > two.budget  # prompts came in chunks
    # again: the prompts' pages come from the prefix cache on every rank
    hits = two.mgr.prefix_stats()["tokens_hit"]
    assert [[o.token_ids for o in c.outputs] for c in two.generate(prompts(), params)] == want
    assert two.mgr.prefix_stats()["tokens_hit"] > hits
    assert two.mgr.num_free_pages == two.mgr.num_pages


def test_speculative_drafts_under_tensor_parallelism(engines):
    from mstar.engine.sampling.speculative import speculator

    one, two = engines
    copies = [p[:8] * 3 for p in prompts()]  # drafts found in the prompt
    params = SamplingParams(max_new_tokens=12)
    want = [c.outputs[0].token_ids for c in one.generate(copies, params)]
    two.spec = speculator("ngram", 4)  # the same workers, drafting
    try:
        got = [c.outputs[0].token_ids for c in two.generate(copies, params)]
        assert got == want and two.spec.accepted > 0
    finally:
        two.spec = None
    assert two.mgr.num_free_pages == two.mgr.num_pages


def test_abort_under_tensor_parallelism_spares_the_others(engines):
    one, two = engines
    params = SamplingParams(max_new_tokens=8)
    want = one.generate(prompts(1)[0], params)[0].outputs[0].token_ids
    keep = two.add_request(prompts(1)[0], params)
    drop = two.add_request(prompts(1)[1], params)
    two.step()
    two.abort(drop)
    while two.has_unfinished():
        for c in two.step():
            if c.finished:
                assert (c.request_id, c.outputs[0].token_ids) == (keep, want)
    assert two.mgr.num_free_pages == two.mgr.num_pages


@pytest.mark.parametrize(
    ("model", "size", "error", "message"),
    [
        (lambda: tiny_llama(kv_heads=3, heads=6), 2, TensorParallelUnsupported,
         "divisible by tensor_parallel_size=2, got num_key_value_heads=3:"),
        (lambda: tiny_llama(kv_heads=4, heads=12), 8, TensorParallelUnsupported,
         "divisible by tensor_parallel_size=8, got num_attention_heads=12 and num_key_value_heads=4"),
        (lambda: tiny_llama(), True, TypeError, "expected tensor_parallel_size an int, got True"),
        (lambda: tiny_llama(), 0, ValueError, "expected tensor_parallel_size >= 1, got 0"),
    ],
)  # fmt: skip
def test_a_model_that_does_not_divide_is_refused_before_any_worker(model, size, error, message):
    before = set(multiprocessing.active_children())
    with pytest.raises(error, match=message):
        Engine(model(), num_pages=8, tensor_parallel_size=size)
    assert set(multiprocessing.active_children()) == before


def test_a_model_without_a_tensor_parallel_plan_is_refused(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64)).eval()
    gpt2.save_pretrained(tmp_path)
    before = set(multiprocessing.active_children())
    with pytest.raises(TensorParallelUnsupported, match="GPT2Config without one"):
        Engine.from_pretrained(str(tmp_path), num_pages=8, tensor_parallel_size=2)
    assert set(multiprocessing.active_children()) == before


def test_one_tensor_parallel_engine_per_process(engines, folder):
    before = set(multiprocessing.active_children())
    with pytest.raises(RuntimeError, match="one tensor-parallel engine per process at a time"):
        Engine.from_pretrained(folder, tensor_parallel_size=2, **OPTIONS)
    assert set(multiprocessing.active_children()) == before


def test_a_killed_worker_fails_the_engine_within_seconds(engines, folder):
    """Last: it breaks the shared group, then closes it."""
    _, eng = engines
    (pid,) = eng.tp.pids
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    killed: list[float] = []

    def kill() -> None:
        os.kill(pid, signal.SIGKILL)
        killed.append(time.monotonic())

    threading.Timer(0.5, kill).start()  # while the engine steps
    with pytest.raises(StepFailed) as failed:
        while True:
            if not eng.has_unfinished():
                eng.add_request(prompts(2)[1], params)
            eng.step()
    assert killed and time.monotonic() - killed[0] < 5
    assert isinstance(failed.value.__cause__, WorkerFailed)
    assert f"tp-rank1 (pid {pid}) exited with code -9" in str(failed.value.__cause__)
    t0 = time.monotonic()
    eng.add_request(prompts(2)[0], SamplingParams(max_new_tokens=2))
    with pytest.raises(StepFailed) as again:  # later steps fail at once, naming the worker
        eng.step()
    assert "cannot step any more" in str(again.value.__cause__)
    assert time.monotonic() - t0 < 1
    eng.close()
    assert eng.tp.closed and not _alive(pid)
    # an option the constructor refuses after from_pretrained started the workers stops them
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="expected token_budget >= 1, got 0"):
        Engine.from_pretrained(folder, tensor_parallel_size=2, num_pages=8, token_budget=0)
    assert set(multiprocessing.active_children()) == before


DEMO = ["demo", "--model", "random", "--check", "--quiet", "--requests", "6",
        "--max-new-tokens", "8", "--tensor-parallel-size", "2"]  # fmt: skip


def _run(command: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE"}
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


def _checked(done: subprocess.CompletedProcess) -> None:
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "7 passed, 0 failed"  # every output as the model's


def test_demo_with_tensor_parallelism_passes_its_check():
    """Spawned workers under the CLI: the demo's forks, guided and sampled
    requests and preemptions, each output recomputed by the unsharded model."""
    _checked(_run([sys.executable, "-m", "mstar.cli", *DEMO]))


def test_the_same_command_runs_under_torchrun():
    """torchrun starts the ranks (its rendezvous, as over several nodes):
    rank 0 drives, rank 1 serves it and exits 0 when it stops."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1"]
    _checked(_run([*torchrun, "--nproc-per-node", "2", "-m", "mstar.cli", *DEMO]))


def test_generate_refuses_smollm2_at_two_ranks_in_one_line(smollm2, capsys):
    assert main(["generate", "--tensor-parallel-size", "2", "hi"]) == 2
    err = capsys.readouterr().err
    heads = "got num_attention_heads=9 and num_key_value_heads=3"
    assert err.count("\n") == 1 and f"divisible by tensor_parallel_size=2, {heads}" in err


def test_generate_at_two_ranks_prints_the_tokens_of_one(smollm2, tmp_path):
    """``mstar-kv generate --tensor-parallel-size 2`` on a model that divides
    (the tiny Llama with SmolLM2's tokenizer, whose vocabulary it takes)."""
    model = tiny_llama()
    model.resize_token_embeddings(len(smollm2[1]))
    model.save_pretrained(tmp_path)
    smollm2[1].save_pretrained(tmp_path)
    gen = [sys.executable, "-m", "mstar.cli", "generate", "--model", str(tmp_path), "--raw"]
    gen += ["--max-new-tokens", "12", "The capital of France is"]
    one, two = (_run([*gen, "--tensor-parallel-size", n]) for n in ("1", "2"))
    assert one.returncode == two.returncode == 0, one.stderr[-2000:] + two.stderr[-2000:]
    assert "(length: 12 tokens" in two.stderr and two.stdout == one.stdout
