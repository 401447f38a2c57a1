"""The serving loop: requests in, tokens out, through the KV plan layer.

Each ``step`` schedules decode rows and prefill chunks under a token budget,
admits them into ``KVManager`` (when the pool is short, the youngest request
holding KV is preempted: it keeps its generated tokens and recomputes prompt
+ generated later), runs one packed forward over the plan with logits only at
rows that choose a token, samples, and gives a finished stream's pages back at
once. ``n > 1`` forks the prompt's stream once it is in (full pages shared);
a guided request decodes ``cond``/``uncond`` in lockstep.
"""

from __future__ import annotations

import itertools
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mstar.engine.request import GUIDED, Completion, CompletionOutput, Request, Sample
from mstar.engine.resources.kv.cache import KVCache
from mstar.engine.resources.kv.manager import AllocationFailed, KVManager
from mstar.engine.resources.step import KVStep, Segment
from mstar.engine.sampling import SamplingParams, make_generator, sample_token
from mstar.engine.scheduler import kv_step, schedule
from mstar.integrations.hf import KVSpec, forward_step, kv_spec, register

Prompt = str | Sequence[int]
# num_pages=None: the pool takes this share of the free device memory (on the
# CPU, of the free host memory, at most HOST_POOL_BYTES: the host is shared)
KV_MEMORY_FRACTION = 0.25
HOST_POOL_BYTES = 1 << 30
PLAN_SAMPLES = 100_000


class RequestTooLarge(ValueError):
    """A request whose KV alone would not fit the page pool at its peak."""


@dataclass
class EngineStats:
    steps: int = 0
    decode_steps: int = 0
    mixed_steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preemptions: int = 0
    refused: int = 0
    peak_pages: int = 0
    peak_shared: int = 0
    plan_s: float = 0.0  # admit + plan + commit (and forks), the plan layer
    step_s: float = 0.0  # whole steps
    # KVManager.plan per step, the latest PLAN_SAMPLES steps
    plan_us: deque[float] = field(default_factory=lambda: deque(maxlen=PLAN_SAMPLES))


class Engine:
    """Continuous batching of a Hugging Face decoder over a paged KV cache.

    ``model`` is switched to the paged attention implementation (it serves
    only through the engine afterwards). ``num_pages=None`` sizes the pool to
    ``KV_MEMORY_FRACTION`` of the free memory (see ``_pool_pages``). String prompts need
    ``tokenizer`` (no chat template is applied); outputs get ``.text`` with one.
    With ``prefix_cache`` a stream that starts (or restarts after preemption)
    first takes the longest run of cached full pages equal to a prefix of its
    tokens, computed by any earlier request, and computes only the rest.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        *,
        num_pages: int | None = None,
        page_size: int = 16,
        token_budget: int = 256,
        flashinfer: Any = None,
        prefix_cache: bool = True,
    ) -> None:
        if token_budget < 1:
            raise ValueError(f"expected token_budget >= 1, got {token_budget}")
        spec = kv_spec(model)  # refuses a model the paged path cannot serve exactly
        model.set_attn_implementation(register())
        param = next(model.parameters())
        self.model, self.tokenizer, self.flashinfer = model, tokenizer, flashinfer
        self.device, self.budget = param.device, token_budget
        if num_pages is None:
            num_pages = _pool_pages(spec, page_size, param.dtype, param.device)
        self.cache = KVCache(
            num_pages=num_pages,
            page_size=page_size,
            dtype=param.dtype,
            device=param.device,
            **spec.cache_kwargs(),
        )
        self.mgr = KVManager(num_pages, page_size, cache=self.cache, prefix_cache=prefix_cache)
        self.prefix_cache = prefix_cache
        self.eos_token_ids = _eos_ids(model, tokenizer)
        self.max_len = getattr(model.config, "max_position_embeddings", None)
        self.stats = EngineStats()
        self._running: dict[str, Request] = {}  # unfinished, oldest first
        self._ids = itertools.count()

    @classmethod
    def from_pretrained(
        cls, name: str, *, device: str = "cpu", dtype: torch.dtype = torch.float32, **kwargs: Any
    ) -> Engine:
        """``name``: ``"smollm2"``, a GGUF file or a Hugging Face model folder.
        ``device="cuda"`` uses FlashInfer when it is installed."""
        from mstar.engine.loader import load

        model, tokenizer = load(name, dtype=dtype)
        if device.startswith("cuda") and "flashinfer" not in kwargs:
            kwargs["flashinfer"] = flashinfer_or_none(device)
        return cls(model.to(device), tokenizer, **kwargs)

    # --- requests ------------------------------------------------------------------------

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        uncond_prompt: Prompt | None = None,
        guidance_scale: float = 1.0,
    ) -> str:
        """Queue a request and return its id. With ``uncond_prompt`` it is
        guided: tokens come from ``uncond + guidance_scale * (cond - uncond)``
        logits (``n`` must be 1). Raises ``RequestTooLarge`` when its KV could
        never fit the pool, ``ValueError`` for anything else invalid."""
        params = params or SamplingParams()
        rid = f"req{next(self._ids)}" if request_id is None else request_id
        if rid in self._running:
            raise ValueError(f"expected a new request id, got {rid!r} (running)")
        ids = self._token_ids(rid, prompt)
        uncond = None if uncond_prompt is None else self._token_ids(rid, uncond_prompt)
        if uncond is not None and params.n != 1:
            raise ValueError(f"request {rid!r}: expected n == 1 when guided, got n={params.n}")
        longest = max(len(ids), len(uncond or ())) + params.max_new_tokens
        if self.max_len is not None and longest > self.max_len:
            raise ValueError(
                f"request {rid!r}: prompt + max_new_tokens = {longest} exceeds the model's"
                f" max_position_embeddings {self.max_len}"
            )
        need = self.peak_pages(len(ids), params, None if uncond is None else len(uncond))
        if need > self.mgr.num_pages:
            raise RequestTooLarge(
                f"request {rid!r} needs {need} KV pages at its peak (prompt {len(ids)} tokens,"
                f" max_new_tokens {params.max_new_tokens}, n {params.n}), the pool has"
                f" {self.mgr.num_pages}"
            )
        samples = [
            Sample(
                i,
                GUIDED if uncond is not None else ("main",) if params.n == 1 else (f"s{i}",),
                None if params.greedy else make_generator(params, i, self.device),
            )
            for i in range(params.n)
        ]
        req = Request(rid, ids, params, samples, uncond=uncond, guidance_scale=guidance_scale)
        req.restart()
        self._running[rid] = req
        return rid

    def peak_pages(
        self, prompt_len: int, params: SamplingParams, uncond_len: int | None = None
    ) -> int:
        """KV pages a request holds at its peak, alone in the pool (the last
        generated token is never fed); ``add_request`` refuses one above
        ``num_pages``."""
        size = self.mgr.page_size

        def pages(tokens: int) -> int:
            return -(-tokens // size)

        longest = prompt_len + params.max_new_tokens - 1
        if uncond_len is not None:
            return pages(longest) + pages(uncond_len + params.max_new_tokens - 1)
        if params.n == 1:
            return pages(longest)
        # the prompt's stream while forking, then each sample's pages past the shared ones
        return pages(prompt_len) + params.n * (pages(longest) - prompt_len // size)

    def abort(self, request_id: str) -> None:
        """Drop a running request; its pages return at once."""
        req = self._running.pop(request_id, None)
        if req is None:
            raise KeyError(f"expected a running request id, got {request_id!r}")
        if self.mgr.labels(request_id):
            self.mgr.release(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._running)

    def generate(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        progress: Callable[[Engine], None] | None = None,
    ) -> list[Completion]:
        """Serve ``prompts`` to the end and return their completions in order
        (``params``: one for all, or one per prompt). The engine must have no
        other request running. ``progress`` is called after each step."""
        if self._running:
            raise ValueError(f"expected no running requests, got {len(self._running)}")
        if isinstance(params, SamplingParams) or params is None:
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"expected {len(prompts)} SamplingParams, got {len(params)}")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        done: dict[str, Completion] = {}
        while self._running:
            done.update((c.request_id, c) for c in self.step() if c.finished)
            if progress is not None:
                progress(self)
        return [done[rid] for rid in ids]

    # --- one step ------------------------------------------------------------------------

    def step(self) -> list[Completion]:
        """Run one step; return the completions of requests that got tokens."""
        t_step = time.perf_counter()
        step = self._admit()
        if step is None:
            return []
        t0 = time.perf_counter()
        plans = self.mgr.plan(step)
        self.stats.plan_us.append((time.perf_counter() - t0) * 1e6)
        self.stats.plan_s += time.perf_counter() - t0
        touched: dict[str, Request] = {}
        forks: list[tuple[Request, torch.Tensor]] = []
        for plan in plans.values():
            ids: list[int] = []
            at: list[int] = []
            chosen: list[tuple[Request, str]] = []
            starts = plan.cpu_indptrs.qo_indptr.tolist()
            for (rid, label), start, end in zip(plan.rows, starts, starts[1:]):
                req = self._running[rid]
                fed = req.fed[label]
                ids += req.streams[label][fed : fed + end - start]
                req.fed[label] = fed + end - start
                touched[rid] = req
                if req.fed[label] == len(req.streams[label]):
                    at.append(end - 1)
                    chosen.append((req, label))
            logits = self._logits(ids, plan, at)
            for (req, label), row in zip(chosen, logits):
                if label == "main" and not req.forked:
                    forks.append((req, row))  # forked after the commit
                else:
                    self._on_logits(req, label, row)
        t0 = time.perf_counter()
        self.mgr.commit(step)
        for req in touched.values():
            self._release_unused(req)
        for req, row in forks:
            if req.fed.get("main") == len(req.prompt):  # not preempted meanwhile
                self._fork(req, row)
        self.stats.plan_s += time.perf_counter() - t0
        self._account(step, time.perf_counter() - t_step)
        return [self._completion(req) for req in touched.values()]

    def _admit(self) -> KVStep | None:
        """The step to run: everything scheduled, or the requests before the
        first that did not fit; with nothing fitting, preempt the youngest
        request holding KV and schedule again. None when nothing is running.
        A request preempted here takes no cached prefix again until the next
        step (it would hold the pages it just gave back: a livelock)."""
        t0 = time.perf_counter()
        preempted: set[str] = set()
        try:
            while self._running:
                segments = schedule(self._running.values(), self.budget)
                while self._reuse_prefixes(segments, preempted):  # less to compute:
                    segments = schedule(self._running.values(), self.budget)  # room for more
                while segments:
                    step = kv_step(segments)
                    try:
                        self.mgr.admit(step)
                        return step
                    except AllocationFailed as err:
                        self.stats.refused += 1
                        order = list(dict.fromkeys(s.request_id for s in segments))
                        keep = set(order[: order.index(err.request_id)])
                        segments = [s for s in segments if s.request_id in keep]
                preempted.add(self._preempt_youngest().id)
            return None
        finally:
            self.stats.plan_s += time.perf_counter() - t0

    def _reuse_prefixes(self, segments: list[Segment], skip: set[str]) -> bool:
        """Streams about to start (scheduled, nothing in the KV cache yet)
        take their longest cached prefix, the requests in ``skip`` excepted;
        True when one did. Matched only when scheduled: pages are registered
        as steps commit, so a stream matched early would miss them."""
        if not self.prefix_cache:
            return False
        matched = False
        for rid, label, _, _ in segments:
            req = self._running[rid]
            if req.fed[label] or rid in skip:
                continue
            if label in self.mgr.labels(rid):  # matched nothing before: match anew
                self.mgr.release(rid, label)
            req.fed[label] = self.mgr.match_prefix(rid, label, req.streams[label])
            matched = matched or req.fed[label] > 0
        return matched

    def _logits(self, ids: list[int], plan: Any, at: list[int]) -> torch.Tensor:
        """Logits ``[len(at), vocab]`` at packed positions ``at`` of the step."""
        input_ids = torch.tensor(ids, device=self.device)
        index = torch.tensor(at, dtype=torch.int64)
        return forward_step(
            self.model, input_ids, plan, self.cache, flashinfer=self.flashinfer, logits_at=index
        )

    def _on_logits(self, req: Request, label: str, logits: torch.Tensor) -> None:
        """A stream's last token is in: choose its sample's next token."""
        if label in GUIDED:
            req.pending[label] = logits
            if len(req.pending) < 2:
                return
            cond, uncond = req.pending.pop("cond"), req.pending.pop("uncond")
            logits = uncond + req.guidance_scale * (cond - uncond)
            sample = req.samples[0]
        else:
            sample = req.samples[0] if label == "main" else req.samples[int(label[1:])]
        self._emit(req, sample, sample_token(logits, req.params, sample.generator))

    def _emit(self, req: Request, sample: Sample, token: int) -> None:
        """Append ``token`` to ``sample``; feed it next, unless it ends the sample
        (its streams are then dropped, and their pages released after the step)."""
        params = req.params
        sample.token_ids.append(token)
        if token in params.stop_token_ids or (
            not params.ignore_eos and token in self.eos_token_ids
        ):
            sample.finish_reason = "stop"
        elif len(sample.token_ids) == params.max_new_tokens:
            sample.finish_reason = "length"
        for label in sample.labels:
            if sample.finish_reason is None:
                req.streams[label].append(token)
            else:
                req.streams.pop(label, None)
                req.fed.pop(label, None)

    def _fork(self, req: Request, logits: torch.Tensor) -> None:
        """The prompt is in: fork ``main`` into a stream per unfinished sample
        (full pages shared, the partial tail copied). A sample with no token yet
        draws its first from ``logits``; one recomputed after a preemption
        feeds its generated tokens on from the prompt."""
        live = [s for s in req.samples if s.finish_reason is None]
        forks = tuple(("main", s.labels[0]) for s in live)
        step = KVStep((Segment(req.id, "main", 0, ()),), post_forks=forks)
        while True:
            try:
                self.mgr.admit(step)
                break
            except AllocationFailed:
                self.stats.refused += 1
                if self._preempt_youngest() is req:
                    return  # recomputed later, and forked then
        self.mgr.commit(step)
        del req.streams["main"], req.fed["main"]
        for sample in live:
            label = sample.labels[0]
            req.streams[label], req.fed[label] = req.prompt + sample.token_ids, len(req.prompt)
            if not sample.token_ids:
                self._emit(req, sample, sample_token(logits, req.params, sample.generator))
        self._release_unused(req)

    def _release_unused(self, req: Request) -> None:
        """Give back the pages of streams the request no longer has; a finished
        request leaves the engine."""
        held = self.mgr.labels(req.id)
        if req.finished:
            if held:
                self.mgr.release(req.id)
            del self._running[req.id]
            return
        for label in held:
            if label not in req.streams:
                self.mgr.release(req.id, label)

    def _preempt_youngest(self) -> Request:
        """Free the youngest request holding KV; it is recomputed later. The
        oldest fits the pool alone, so some request always makes progress."""
        holding = [r for r in self._running.values() if r.holds_kv()]
        assert holding, "nothing fits an empty pool: add_request should have refused it"
        req = holding[-1]
        self.mgr.release(req.id)
        req.restart()
        self.stats.preemptions += 1
        return req

    # --- records -------------------------------------------------------------------------

    def _completion(self, req: Request) -> Completion:
        outputs = []
        for s in req.samples:
            ids = s.token_ids[:-1] if s.finish_reason == "stop" else s.token_ids
            text = None if self.tokenizer is None else self.tokenizer.decode(ids)
            outputs.append(CompletionOutput(s.index, list(s.token_ids), text, s.finish_reason))
        return Completion(req.id, list(req.prompt), outputs)

    def _token_ids(self, rid: str, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"request {rid!r}: expected token ids (no tokenizer), got a str")
            ids = list(self.tokenizer.encode(prompt))
        else:
            ids = [int(t) for t in prompt]
        vocab = self.model.config.vocab_size
        if not ids or not all(0 <= t < vocab for t in ids):
            raise ValueError(
                f"request {rid!r}: expected a non-empty prompt of ids in [0, {vocab}), got {ids[:8]}"
            )
        return ids

    def _account(self, step: KVStep, seconds: float) -> None:
        s = self.stats
        spans = [seg.span for seg in step.segments]
        s.steps += 1
        s.step_s += seconds
        s.decode_steps += all(x == 1 for x in spans)
        s.mixed_steps += any(x == 1 for x in spans) and any(x > 1 for x in spans)
        s.prefill_tokens += sum(x for x in spans if x > 1)
        s.decode_tokens += sum(x for x in spans if x == 1)
        s.peak_pages = max(s.peak_pages, self.mgr.num_pages - self.mgr.num_free_pages)
        s.peak_shared = max(s.peak_shared, self.mgr.shared_pages())


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """EOS ids from the model's generation config, else its config, else the tokenizer."""
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is not None:
            return frozenset([eos] if isinstance(eos, int) else eos)
    return frozenset()


def _pool_pages(spec: KVSpec, page_size: int, dtype: torch.dtype, device: torch.device) -> int:
    """Pages filling ``KV_MEMORY_FRACTION`` of the free memory of ``device``
    (on the host, at most ``HOST_POOL_BYTES``)."""
    per_token = spec.num_layers * spec.num_kv_heads * (spec.head_dim + spec.v_head_dim)
    page_bytes = per_token * page_size * dtype.itemsize
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        free = min(free, int(HOST_POOL_BYTES / KV_MEMORY_FRACTION))
    return max(1, int(free * KV_MEMORY_FRACTION) // page_bytes)


def flashinfer_or_none(device: str) -> Any:
    """FlashInfer's paged attention on ``device``, or None (PyTorch's) without it."""
    from mstar.engine.resources.attn.flashinfer import FlashInferPagedAttention

    try:
        return FlashInferPagedAttention(device=device)
    except RuntimeError:
        return None
