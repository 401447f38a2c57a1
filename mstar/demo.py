"""A small continuous-batching server over the plan layer, and its checker.

Requests arrive over time; each step packs decode rows and chunked prefill
under a token budget, admits the step into ``KVManager`` (refused work waits;
when nothing fits, the youngest request is preempted and recomputed later),
and runs one packed forward per plan label through ``forward_step``. A request
asking for ``n`` continuations forks its prompt's stream into ``n`` labels
(full pages shared); a guided request decodes ``cond`` and ``uncond`` streams
in lockstep under one combined plan label. ``check`` recomputes every request
with the model alone.
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from mstar.engine.resources.kv.cache import KVCache
from mstar.engine.resources.kv.manager import AllocationFailed, KVManager
from mstar.engine.resources.step import KVStep, Segment
from mstar.integrations.hf import forward_step, register

GUIDED = ("cond", "uncond")


@dataclass
class Request:
    """One request. ``streams`` maps each live label to its tokens (prompt,
    then generated) and ``fed`` to how many of them are in the KV cache. A
    plain request has ``main``; one with ``n > 1`` has ``main`` until its
    prompt is in, then ``s0..s{n-1}``; a guided one has ``cond``/``uncond``."""

    id: str
    prompt: list[int]
    max_new_tokens: int
    arrival: int
    n: int = 1
    uncond: list[int] | None = None
    guidance: float = 0.0
    streams: dict[str, list[int]] = field(default_factory=dict)
    fed: dict[str, int] = field(default_factory=dict)
    outputs: dict[str, list[int]] = field(default_factory=dict)  # label -> generated
    pending: dict[str, torch.Tensor] = field(default_factory=dict)  # guided: last logits

    def restart(self) -> None:
        """Back to nothing computed (greedy decoding recomputes the same tokens)."""
        if self.uncond is None:
            self.streams = {"main": list(self.prompt)}
        else:
            self.streams = {"cond": list(self.prompt), "uncond": list(self.uncond)}
        self.fed = dict.fromkeys(self.streams, 0)
        self.outputs, self.pending = {}, {}

    @property
    def done(self) -> bool:
        want = self.n if self.n > 1 else 1
        return len(self.outputs) == want and all(
            len(o) == self.max_new_tokens for o in self.outputs.values()
        )


def make_workload(num_requests: int, vocab: int, seed: int) -> list[Request]:
    """Varied prompts arriving over time; about one in six asks for 2-3
    continuations, and one (when there are at least three) is guided."""
    rng = random.Random(seed)
    requests = []
    for i in range(num_requests):
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(5, 48))]
        req = Request(f"req{i}", prompt, rng.randint(4, 16), arrival=i * rng.randint(1, 3))
        if i % 6 == 2:
            req.n = rng.randint(2, 3)
        if i == 1 and num_requests >= 3:
            req.uncond = [rng.randrange(1, vocab) for _ in range(rng.randint(3, 12))]
            req.guidance = 1.5
        req.restart()
        requests.append(req)
    return requests


def peak_pages(req: Request, page_size: int) -> int:
    """Pages the request holds at its peak, alone in the pool."""

    def pages(tokens: int) -> int:
        return -(-tokens // page_size)

    if req.uncond is not None:
        return pages(len(req.prompt) + req.max_new_tokens) + pages(
            len(req.uncond) + req.max_new_tokens
        )
    total = len(req.prompt) + req.max_new_tokens
    if req.n == 1:
        return pages(total)
    shared = len(req.prompt) // page_size
    # the prompt's stream while forking, then each sample's own pages
    return pages(len(req.prompt)) + req.n * (pages(total) - shared)


@dataclass
class Stats:
    steps: int = 0
    decode_steps: int = 0
    mixed_steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preemptions: int = 0
    refused: int = 0
    peak_pages: int = 0
    peak_shared: int = 0
    plan_us: list[float] = field(default_factory=list)


class Server:
    """The serving loop: schedule, admit, plan, forward, commit."""

    def __init__(
        self,
        model: torch.nn.Module,
        requests: list[Request],
        *,
        num_pages: int,
        page_size: int,
        token_budget: int,
        flashinfer=None,
    ) -> None:
        config = model.config
        self.model = model
        self.requests = requests
        self.budget = token_budget
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        device = next(model.parameters()).device
        self.cache = KVCache(
            config.num_hidden_layers,
            num_pages,
            page_size,
            config.num_key_value_heads,
            head_dim,
            dtype=next(model.parameters()).dtype,
            device=device,
        )
        self.mgr = KVManager(num_pages, page_size, cache=self.cache)
        self.flashinfer = flashinfer
        self.device = device
        self.stats = Stats()
        self.step_index = 0

    # --- scheduling ---------------------------------------------------------------------

    def running(self) -> list[Request]:
        """Arrived, unfinished requests, oldest first."""
        return [r for r in self.requests if r.arrival <= self.step_index and not r.done]

    def schedule(self, requests: list[Request]) -> list[Segment]:
        """Decode rows first (one token each), then prefill chunks, under the
        token budget; a guided request's two streams decode together."""
        budget = self.budget
        segments = []
        for req in requests:
            rows = [
                (label, 1) for label, toks in req.streams.items() if len(toks) - req.fed[label] == 1
            ]
            if rows and len(rows) <= budget:
                segments += [Segment(req.id, label, 1) for label, _ in rows]
                budget -= len(rows)
        for req in requests:
            for label, toks in req.streams.items():
                left = len(toks) - req.fed[label]
                if left > 1 and budget > 0:
                    segments.append(Segment(req.id, label, min(left, budget)))
                    budget -= segments[-1].span
        return segments

    @staticmethod
    def combined(segments: list[Segment]) -> dict[tuple[str, ...], str]:
        """Pack every text label into one plan label, and cond/uncond into
        another when both have segments this step (a combined source with
        none would be refused)."""
        labels = list(dict.fromkeys(s.label for s in segments))
        out = {}
        text = tuple(label for label in labels if label not in GUIDED)
        if text:
            out[text] = "text"
        if all(label in labels for label in GUIDED):
            out[GUIDED] = "cfg"
        return out

    def admit(self) -> KVStep | None:
        """The step to run: everything scheduled, or the prefix of requests
        that fits; with nothing fitting, preempt the youngest and try again."""
        while True:
            active = self.running()
            if not active:
                return None
            segments = self.schedule(active)
            while segments:
                step = KVStep(tuple(segments), combined_labels=self.combined(segments))
                try:
                    self.mgr.admit(step)
                    return step
                except AllocationFailed as err:  # keep the requests before the one that did not fit
                    self.stats.refused += 1
                    order = list(dict.fromkeys(s.request_id for s in segments))
                    keep = set(order[: order.index(err.request_id)])
                    segments = [s for s in segments if s.request_id in keep]
            self.preempt_youngest()

    def preempt_youngest(self) -> Request:
        """Free the youngest request holding KV; it will be recomputed. The
        oldest is never the victim while another holds KV, and it fits the
        pool alone, so the server always makes progress."""
        holding = [r for r in self.running() if any(r.fed.values())]
        assert holding, "nothing fits an empty pool: the pool check should have refused this"
        req = max(holding, key=lambda r: r.arrival)
        self.mgr.release(req.id)
        req.restart()
        self.stats.preemptions += 1
        return req

    # --- one step -----------------------------------------------------------------------

    def step(self) -> bool:
        """Run one step; False when every request is done."""
        if all(r.done for r in self.requests):
            return False
        step = self.admit()
        if step is None:  # nothing has arrived yet
            self.step_index += 1
            return True
        t0 = time.perf_counter()
        plans = self.mgr.plan(step)
        self.stats.plan_us.append((time.perf_counter() - t0) * 1e6)
        by_id = {r.id: r for r in self.requests}
        forks: list[tuple[Request, torch.Tensor]] = []
        for plan in plans.values():
            counts = np.diff(plan.cpu_indptrs.qo_indptr.numpy())
            ids = []
            for (rid, label), n in zip(plan.rows, counts.tolist()):
                req = by_id[rid]
                ids += req.streams[label][req.fed[label] : req.fed[label] + n]
            logits = forward_step(
                self.model,
                torch.tensor(ids, device=self.device),
                plan,
                self.cache,
                flashinfer=self.flashinfer,
            )
            ends = np.cumsum(counts) - 1
            for (rid, label), n, end in zip(plan.rows, counts.tolist(), ends.tolist()):
                req = by_id[rid]
                req.fed[label] += n
                if req.fed[label] != len(req.streams[label]):
                    continue
                if label == "main" and req.n > 1:
                    forks.append((req, logits[end]))  # after the commit: the fork copies the prompt
                else:
                    self.on_logits(req, label, logits[end])
        self.mgr.commit(step)
        for req, logits in forks:
            if req.fed.get("main") == len(req.prompt):  # not preempted by an earlier fork
                self.fork(req, logits)
        self.account(step)
        for rid in dict.fromkeys(s.request_id for s in step.segments):
            if by_id[rid].done:  # finished: its pages go back to the pool
                self.mgr.release(rid)
        self.step_index += 1
        return True

    def on_logits(self, req: Request, label: str, logits: torch.Tensor) -> None:
        """A stream's last token was fed: choose what comes next."""
        if label in GUIDED:
            req.pending[label] = logits
            if len(req.pending) == 2:
                cond, uncond = req.pending.pop("cond"), req.pending.pop("uncond")
                self.emit(
                    req,
                    ("cond", "uncond"),
                    "cfg",
                    int((uncond + req.guidance * (cond - uncond)).argmax()),
                )
        else:
            self.emit(req, (label,), label, int(logits.argmax()))

    def emit(self, req: Request, labels: tuple[str, ...], output: str, token: int) -> None:
        generated = req.outputs.setdefault(output, [])
        generated.append(token)
        if len(generated) < req.max_new_tokens:  # the last token need not be fed
            for label in labels:
                req.streams[label].append(token)

    def fork(self, req: Request, logits: torch.Tensor) -> None:
        """The prompt is in: fork ``main`` into ``n`` samples that share its
        full pages, each starting from a different one of the top tokens."""
        labels = [f"s{i}" for i in range(req.n)]
        step = KVStep((Segment(req.id, "main", 0),), post_forks=tuple(("main", s) for s in labels))
        while True:
            try:
                self.mgr.admit(step)
                break
            except AllocationFailed:
                if self.preempt_youngest() is req:
                    return  # recomputed later, and forked then
        self.mgr.commit(step)
        self.mgr.release(req.id, "main")
        prompt = req.streams.pop("main")
        del req.fed["main"]
        for label, token in zip(labels, logits.topk(req.n).indices.tolist()):
            req.streams[label], req.fed[label] = list(prompt), len(prompt)
            self.emit(req, (label,), label, token)

    def account(self, step: KVStep) -> None:
        s = self.stats
        spans = [seg.span for seg in step.segments]
        s.steps += 1
        s.decode_steps += all(x == 1 for x in spans)
        s.mixed_steps += any(x == 1 for x in spans) and any(x > 1 for x in spans)
        s.prefill_tokens += sum(x for x in spans if x > 1)
        s.decode_tokens += sum(x for x in spans if x == 1)
        s.peak_pages = max(s.peak_pages, self.mgr.num_pages - self.mgr.num_free_pages)
        s.peak_shared = max(s.peak_shared, self.mgr.shared_pages())


def build_model(seed: int, device: str = "cpu") -> tuple[torch.nn.Module, torch.nn.Module]:
    """A seeded random Llama (no download), and its twin on the paged
    attention: the first is the oracle ``check`` compares against."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    reference = LlamaForCausalLM(config).eval().to(device)
    paged = copy.deepcopy(reference)
    paged.set_attn_implementation(register())
    return reference, paged


def serve(server: Server, progress: Callable[[Server], None] | None = None) -> Stats:
    while server.step():
        if progress is not None:
            progress(server)
    return server.stats


@torch.no_grad()
def check(reference: torch.nn.Module, requests: list[Request]) -> list[tuple[str, bool]]:
    """Each request's tokens recomputed by the model alone: ``generate`` for
    plain requests and for each continuation (on the prompt plus its first
    token), the model's own forward on both prompts each step for the guided
    one. Returns (what, passed) per output."""
    device = next(reference.parameters()).device
    results = []
    for req in requests:
        if req.uncond is not None:
            cond, uncond, want = list(req.prompt), list(req.uncond), []
            for _ in range(req.max_new_tokens):
                c = reference(torch.tensor([cond], device=device)).logits[0, -1]
                u = reference(torch.tensor([uncond], device=device)).logits[0, -1]
                token = int((u + req.guidance * (c - u)).argmax())
                want.append(token)
                cond.append(token)
                uncond.append(token)
            results.append((f"{req.id} (guided)", req.outputs.get("cfg") == want))
            continue
        for label, got in sorted(req.outputs.items()):
            prefix = req.prompt + got[:1] if req.n > 1 else req.prompt
            new = req.max_new_tokens - (len(prefix) - len(req.prompt))
            ids = torch.tensor([prefix], device=device)
            out = reference.generate(ids, max_new_tokens=new, do_sample=False) if new else ids
            want = out[0, len(req.prompt) :].tolist()
            results.append((f"{req.id}/{label}", got == want))
    return results
