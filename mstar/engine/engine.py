"""The serving loop: requests in, tokens out, through the KV plan layer.

Each ``step`` schedules decode rows and prefill chunks under a token budget,
admits them into ``KVManager`` (``Admitter``: when the pool is short, the
youngest request holding KV is preempted: it keeps its generated tokens and
recomputes prompt + generated later), runs one packed forward over the plan
(``batch.pack``) with logits only at rows that choose a token, samples
(``Emitter``), and gives a finished stream's pages back at once. ``n > 1``
forks the prompt's stream once it is in (full pages shared); a guided request
decodes ``cond``/``uncond`` in lockstep.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from mstar.engine.admitter import Admitter
from mstar.engine.batch import pack
from mstar.engine.build import (
    check_options,
    checked_forward,
    eos_ids,
    from_pretrained,
    kv_cache_dtype_of,
    kv_managers,
    stops_workers_on_error,
)
from mstar.engine.emitter import Emitter
from mstar.engine.intake import Intake
from mstar.engine.prompts import NOT_A_SEQUENCE, chat_ids, chat_list, prompt_list
from mstar.engine.records import EngineStats, StepFailed
from mstar.engine.request import Completion, Request
from mstar.engine.resources.groups import KVGroups
from mstar.engine.resources.step import KVStep
from mstar.engine.sampling.logits import LogitsPipeline
from mstar.engine.sampling.params import SamplingParams
from mstar.engine.sampling.speculative import speculator
from mstar.models.device import check_pool_fits, page_bytes_of, pool_pages
from mstar.models.hf import forward_step, kv_spec, register, runs_fused
from mstar.models.tp import shard

Prompt = str | Sequence[int]
Message = dict[str, str]


class Engine:
    """Continuous batching of a Hugging Face decoder over a paged KV cache.

    ``model`` is switched to the paged attention implementation (it serves
    only through the engine afterwards). ``num_pages=None`` sizes the pool to
    ``kv_cache_memory`` bytes, by default ``KV_MEMORY_FRACTION`` of the free
    memory (the host's available: ``MemAvailable``), at most 1 GiB on the
    host (see ``device.pool_pages``;
    ``engine.kv_cache_bytes`` says what it came to). String
    prompts and chats need ``tokenizer`` (a Hugging Face fast tokenizer);
    outputs get ``.text`` with one. With ``prefix_cache`` a stream that starts
    (or restarts after preemption) first takes the longest cached prefix of
    its tokens, computed by any earlier request (full pages shared, then a
    cached partial page's tokens copied), and computes only the rest. ``prefix_cache=None`` (the default) turns it on
    unless some attention layer of the model has a sliding window: such
    layers then give the pages behind their window back to the pool, which a
    prefix cache would keep (the two do not combine yet).

    A hybrid model (windowed and full layers; prefix cache off, no tensor
    parallelism) is served through KV groups of ``k`` layers on one page pool
    (``KVGroups``): ``num_pages`` then means the same memory as ``num_pages``
    pages over every layer, a pool of ``num_pages * num_layers // k`` pages
    of ``k`` layers (``engine.mgr.num_pages``), which the groups' pages (a
    request's peak counts each group's) share.

    With ``tensor_parallel_size=N > 1`` the model is sharded over N ranks
    (``mstar.models.tp``): this process plans, samples and runs rank 0;
    N - 1 worker processes run the other shards, each with a ``KVCache`` of
    its own KV heads. ``close()`` (or ``with Engine(...)``) stops them.

    ``compile=True`` runs the model's forward under ``torch.compile``
    (compiled at once, on a warm-up request; ``engine.compiled`` says
    ``"compiled (N s)"`` or why it fell back to eager; None: eager as asked):
    see ``mstar.models.compiled``. Any mode but eager float32 (half-precision
    weights, compiled) is checked at start-up against an eager float32 copy
    of the model on a few fixed prompts (``mstar.engine.verify``;
    ``engine.mode_check`` holds the result): a compiled forward that
    disagrees falls back to eager, an eager one raises ``ModeMismatch``.

    ``kv_cache_dtype`` (``"auto"``: the model's dtype) may be ``"bfloat16"``
    or ``"float16"`` (or the torch dtype) under float32 activations on the
    CPU: keys and values rounded into a cache of half the bytes, read back as
    float32 (``build.kv_cache_dtype_of`` says what is refused); a mode the
    start-up check compares with eager float32.

    ``fused`` (the default) runs an eager Llama-family model on the CPU
    through fused decoder layers (``mstar.models.llama.step``: the same
    logits up to float32 rounding, a fraction of the host work);
    ``fused=False`` runs HF's own forward, for comparison. ``engine.fused``
    says whether it runs (a compiled forward is HF's, compiled).

    A call that raises leaves the engine as it found it: nothing of that call
    stays queued, no page leaks.
    """

    @stops_workers_on_error
    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        *,
        num_pages: int | None = None,
        page_size: int = 16,
        token_budget: int = 256,
        flashinfer: Any = None,
        prefix_cache: bool | None = None,
        tensor_parallel_size: int = 1,
        speculative: str | None = None,
        num_speculative_tokens: int = 4,
        compile: bool = False,
        fused: bool = True,
        kv_cache_dtype: str | torch.dtype = "auto",
        kv_cache_memory: int | None = None,
    ) -> None:
        check_options(
            tokenizer, num_pages, page_size, token_budget, prefix_cache, compile, kv_cache_memory
        )
        if not isinstance(fused, bool):
            raise TypeError(f"expected fused a bool, got {fused!r}")
        self.spec = speculator(speculative, num_speculative_tokens)  # see speculative.py
        self.tp = shard(model, tensor_parallel_size)  # refuses before starting workers
        model = model if self.tp is None else self.tp.model
        self._forward_step = (
            functools.partial(forward_step, fused=fused)
            if self.tp is None
            else self.tp.forward_step
        )
        spec = kv_spec(model)  # refuses a model the paged path cannot serve exactly
        if prefix_cache is None:  # windows release pages, which a prefix cache would keep
            prefix_cache = all(window is None for window, _ in spec.groups)
        param = next(model.parameters())
        kv_dtype = kv_cache_dtype_of(kv_cache_dtype, param, self.tp, flashinfer)
        if num_pages is None:
            num_pages = pool_pages(spec, page_size, kv_dtype, param.device, kv_cache_memory)
        check_pool_fits(spec, num_pages, page_size, kv_dtype, param.device)
        self.kv_cache_bytes = num_pages * page_bytes_of(spec, page_size, kv_dtype)
        model.set_attn_implementation(register())
        self.model, self.tokenizer, self.flashinfer = model, tokenizer, flashinfer
        self.device, self.budget = param.device, token_budget
        self.mgr, self.cache = kv_managers(
            spec, num_pages, page_size, param, prefix_cache, self.tp, flashinfer, kv_dtype
        )
        windows = self.mgr.windows if isinstance(self.mgr, KVGroups) else (self.mgr.window,)
        self.prefix_cache = prefix_cache
        eos = eos_ids(model, tokenizer)
        self.pipeline = LogitsPipeline(tokenizer, model.config.vocab_size, eos)
        self.emitter = Emitter(self.pipeline, eos)
        self.intake = Intake(
            tokenizer,
            model.config.vocab_size,
            getattr(model.config, "max_position_embeddings", None),
            page_size,
            self.mgr.num_pages,
            self.device,
            windows,  # what admission counts
            token_budget,
            grammars=self.pipeline.grammars,
        )
        self.stats = EngineStats()
        self._running: dict[str, Request] = {}  # unfinished, oldest first
        self._ids = itertools.count()
        self.admitter = Admitter(
            self.mgr, self._running, token_budget, self.intake.max_chunk, prefix_cache
        )
        # compiled: None, eager as asked; else "compiled (N s)" or why it runs eager
        # mode_check: how the mode agreed with eager float32 (None: float32 eager, unchecked)
        self.compiled, self.mode_check = checked_forward(self, compile)
        self._fused = fused and self.tp is None and flashinfer is None

    @property
    def fused(self) -> bool:
        """Whether steps run the fused forward (``mstar.models.llama.step``):
        asked for, and the model (as it is now: not compiled) one it serves."""
        return self._fused and runs_fused(self.model)

    @classmethod
    def from_pretrained(
        cls,
        name: str | os.PathLike[str],
        *,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = torch.float32,
        quantization: str = "none",
        **kwargs: Any,
    ) -> Engine:
        """``name``: ``"smollm2"``, a GGUF file or a Hugging Face model folder.
        ``dtype``: ``"auto"`` (bfloat16 on CUDA and on CPUs with a native
        bfloat16 matmul, else float32), ``"float32"`` (the default: exact
        against HF), ``"bfloat16"``, ``"float16"`` or a torch dtype; see
        ``mstar.models.dtypes``. ``quantization``: ``"none"`` (the default:
        float weights, a GGUF dequantized to float32), ``"gguf"`` (a GGUF's
        own 4/8-bit weights), ``"int8"``/``"int4"`` (quantized at load) or
        ``"auto"``; see ``mstar.cpu.quant``. ``compile=True`` compiles the forward
        (``mstar.models.compiled``).
        ``device="cuda"`` uses FlashInfer when it is installed and serves the
        model (fp16/bf16 weights, head width 64/128/256); else ``paged_attention``.
        With ``tensor_parallel_size=N > 1`` each rank loads only its shard."""
        return from_pretrained(cls, name, device, dtype, kwargs, quantization)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the model's weights (and of the KV cache, unless
        ``kv_cache_dtype`` made it half precision: ``cache.dtype``; a
        half-precision mode that disagreed with float32 at start-up never
        gets here: see ``mode_check``)."""
        return next(self.model.parameters()).dtype

    # --- requests ------------------------------------------------------------------------

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        uncond_prompt: Prompt | None = None,
        guidance_scale: float = 1.0,
        cache_namespace: str = "",
    ) -> str:
        """Queue a request and return its id. ``prompt``: a str (tokenized as
        is) or a sequence of token ids. With ``uncond_prompt`` it is guided:
        tokens come from ``uncond + guidance_scale * (cond - uncond)`` logits
        (``n`` must be 1). ``cache_namespace``: the prefix cache reuses KV
        only among requests of the same one ("" by default: a tenant's own,
        a salt). Raises ``RequestTooLarge`` when its KV could never
        fit the pool, ``TypeError``/``ValueError`` for anything else invalid,
        before anything is queued."""
        if not isinstance(cache_namespace, str):
            raise TypeError(f"expected cache_namespace a str, got {cache_namespace!r:.60}")
        req = self._request(prompt, params, request_id, uncond_prompt, guidance_scale)
        req.cache_namespace = cache_namespace
        self._running[req.id] = req
        return req.id

    def encode_chat(self, messages: Sequence[Message]) -> list[int]:
        """The prompt ids of an OpenAI-style conversation (``[{"role":
        "system"|"user"|"assistant", "content": str}, ...]``) through the
        tokenizer's chat template, the generation prompt added."""
        return chat_ids(self.tokenizer, messages)

    def chat(
        self,
        conversations: Sequence[Message] | Sequence[Sequence[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """``generate`` on one conversation or a list of them (see ``encode_chat``)."""
        return self.generate([self.encode_chat(c) for c in chat_list(conversations)], params)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        progress: Callable[[Engine], None] | None = None,
    ) -> list[Completion]:
        """Serve ``prompts`` (one prompt, or a list) to the end and return
        their completions in order, always a list (``params``: one for all, or
        one per prompt). The engine must have no other request running.
        ``progress`` is called after each step."""
        done: dict[str, Completion] = {}
        requests = self._requests(prompts, params)
        with contextlib.closing(self._serve(requests)) as steps:
            for completions in steps:
                done.update((c.request_id, c) for c in completions if c.finished)
                if progress is not None:
                    progress(self)
        return [done[r.id] for r in requests]

    def stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[Completion]:
        """Serve ``prompts`` as ``generate`` does, yielding each step's
        completions (those that got tokens) as they come: each output's
        ``.delta`` is its text made final since it was last yielded, the last
        one of a sample carries its ``finish_reason``. Arguments are checked
        here; the requests are queued at the first ``next``, and closing the
        iterator (or dropping it) aborts those still running."""
        requests = self._requests(prompts, params)

        def completions() -> Iterator[Completion]:
            with contextlib.closing(self._serve(requests)) as steps:
                for done in steps:
                    yield from done

        return completions()

    def abort(self, request_id: str) -> None:
        """Drop a running request; its pages return at once."""
        self.admitter.abort(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._running)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The tokens that end a sample (unless ``ignore_eos``); settable."""
        return self.emitter.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: frozenset[int]) -> None:
        self.emitter.eos_token_ids = ids

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent); the engine
        cannot step afterwards. Also at exit, and by ``with Engine(...)``."""
        if self.tp is not None:
            self.tp.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _requests(self, prompts: object, params: object) -> list[Request]:
        """The requests of a ``generate``/``stream`` call, checked, none queued."""
        if self._running:
            raise ValueError(
                f"expected no running requests (add_request/step serve those alongside),"
                f" got {len(self._running)}"
            )
        prompts = prompt_list(prompts)
        if isinstance(params, SamplingParams) or params is None:
            params = [params or SamplingParams()] * len(prompts)
        elif isinstance(params, NOT_A_SEQUENCE) or not isinstance(params, Sequence):
            raise TypeError(f"expected SamplingParams or a list of them, got {params!r:.60}")
        if len(params) != len(prompts):
            raise ValueError(f"expected {len(prompts)} SamplingParams, got {len(params)}")
        return [self._request(p, sp) for p, sp in zip(prompts, params)]

    def _serve(self, requests: list[Request]) -> Iterator[list[Completion]]:
        """Queue ``requests`` and step until they are done, yielding each
        step's completions of theirs; closed early (or on an error), the
        requests still running are aborted."""
        if self._running:
            raise ValueError(f"expected no running requests, got {len(self._running)}")
        ours = {r.id for r in requests}
        self._running.update((r.id, r) for r in requests)
        try:
            while ours & self._running.keys():
                yield [c for c in self.step() if c.request_id in ours]
        finally:
            for rid in ours & self._running.keys():
                self.abort(rid)

    def _request(
        self,
        prompt: object,
        params: object,
        request_id: object = None,
        uncond_prompt: object = None,
        guidance_scale: object = 1.0,
    ) -> Request:
        """A checked request with a new id, not queued."""
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"expected request_id a str or None, got {request_id!r}")
        if request_id in self._running:
            raise ValueError(f"expected a new request id, got {request_id!r} (running)")
        rid = request_id
        while rid is None or rid in self._running:  # an id of its own, not a user's
            rid = f"req{next(self._ids)}"
        return self.intake.request(rid, prompt, params, uncond_prompt, guidance_scale)

    @property
    def max_len(self) -> int | None:
        """The most tokens (prompt and generated) a request may span: the
        model's ``max_position_embeddings`` unless ``limit_context`` lowered it."""
        return self.intake.max_len

    def limit_context(self, tokens: int) -> None:
        """Requests span at most ``tokens`` (prompt and generated), at most
        the model's own context; ``ValueError`` naming the numbers else."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 2:
            raise ValueError(f"expected a context of at least 2 tokens, got {tokens!r}")
        if self.max_len is not None and tokens > self.max_len:
            raise ValueError(
                f"expected a context within the model's {self.max_len} tokens, got {tokens}"
            )
        self.intake = dataclasses.replace(self.intake, max_len=tokens)

    def peak_pages(
        self, prompt_len: int, params: SamplingParams, uncond_len: int | None = None
    ) -> int:
        """KV pages a request holds at its peak, alone in the pool (the last
        generated token is never fed; on a hybrid's KV groups, the sum over
        the groups); ``add_request`` refuses one above the pool's
        ``mgr.num_pages``."""
        return self.intake.peak_pages(prompt_len, params, uncond_len)

    # --- one step ------------------------------------------------------------------------

    def step(self) -> list[Completion]:
        """Run one step; return the completions of requests that got tokens,
        each output with its ``.delta``. When the forward or the sampling
        fails, the requests the step scheduled are aborted (pages freed) and
        ``StepFailed`` is raised (a ``KeyboardInterrupt`` passes as it is)."""
        t_step = time.perf_counter()
        if self.spec is None:
            return self._step(t_step)
        self.spec.propose(self._running.values(), self.budget, self.eos_token_ids)
        try:
            return self._step(t_step)
        finally:  # drafts it did not verify come off, whatever happened
            self.spec.settle(self.stats)

    def _step(self, t_step: float) -> list[Completion]:
        step = self.admitter.next_step(self.stats)
        if step is None:
            return []
        committed = False
        try:
            touched, forks = self._compute(step)
            t0 = time.perf_counter()
            self.mgr.commit(step, None if self.spec is None else self.spec.kept(step))
            committed = True
            for req in touched:
                self.admitter.release_unused(req)
            for req, row in forks:
                if req.fed.get("main") == len(req.prompt):  # not preempted meanwhile
                    self._fork(req, row)
            self.stats.plan_s += time.perf_counter() - t0
        except BaseException as err:
            if not committed:
                self.mgr.abort(step)
            failed = tuple(dict.fromkeys(seg.request_id for seg in step.segments))
            for rid in failed:
                if rid in self._running:
                    self.abort(rid)
            if isinstance(err, Exception):
                raise StepFailed(failed) from err
            raise
        self.stats.account(step, time.perf_counter() - t_step, self.mgr)
        return [req.completion() for req in touched if req.has_news()]

    def _compute(self, step: KVStep) -> tuple[list[Request], list[tuple[Request, torch.Tensor]]]:
        """Plan, forward and sample ``step``: the requests it touched, and the
        ``(request, logits)`` of those to fork once it is committed."""
        t0 = time.perf_counter()
        plans = self.mgr.plan(step)
        self.stats.plan_us.append((time.perf_counter() - t0) * 1e6)
        self.stats.plan_s += time.perf_counter() - t0
        touched: dict[str, Request] = {}
        forks: list[tuple[Request, torch.Tensor]] = []
        on_logits = self.emitter.on_logits
        for plan in plans.values():
            ids, at, prompt_rows, chosen = pack(plan, self._running, touched)
            logits = self._logits(ids, plan, at)
            self.pipeline.prompt(logits[: len(prompt_rows)], prompt_rows)
            logits = logits[len(prompt_rows) :]
            rows = (
                zip(chosen, self.pipeline.rows(logits, chosen))
                if self.spec is None
                else self.spec.verify(self, chosen, logits)
            )
            for (req, label), row in rows:
                if label == "main" and not req.forked:
                    forks.append((req, row))  # forked after the commit
                else:
                    on_logits(req, label, row)
        return list(touched.values()), forks

    def _logits(self, ids: list[int], plan: Any, at: list[int]) -> torch.Tensor:
        """Logits ``[len(at), vocab]`` at packed positions ``at`` of the step."""
        input_ids = torch.tensor(ids, device=self.device)
        index = None if self._every_token(ids, at) else torch.tensor(at, dtype=torch.int64)
        return self._forward_step(
            self.model, input_ids, plan, self.cache, flashinfer=self.flashinfer, logits_at=index
        )

    def _every_token(self, ids: list[int], at: list[int]) -> bool:
        """Whether ``at`` is every token of the step in order (a decode step's),
        for an eager forward: then the head runs over the whole step, with no
        index made, checked and gathered (a compiled forward always gets the
        index: another input would compile it again)."""
        return at == list(range(len(ids))) and "forward" not in vars(self.model)

    def _fork(self, req: Request, logits: torch.Tensor) -> None:
        """The prompt is in: fork ``main`` into a stream per unfinished sample
        (``Admitter.fork``); each feeds on from the prompt, one with no token
        yet drawing its first from ``logits`` (``Emitter.forked``)."""
        live = self.admitter.fork(req, self.stats)
        if live is None:
            return  # preempted: recomputed later, and forked then
        self.emitter.forked(req, live, logits)
        self.admitter.release_unused(req)
