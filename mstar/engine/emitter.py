"""The sampling hand-off: a stream's logits row to its sample's next token, and
the request's state after it (a guided pair combined, stops applied, forked
streams fed)."""

from __future__ import annotations

import torch

from mstar.engine.request import GUIDED, Request, Sample
from mstar.engine.sampling.logits import LogitsPipeline


class Emitter:
    """One engine's: its ``pipeline`` (what runs around the sampler) and
    ``eos_token_ids``, the tokens that end a sample unless it ignores EOS
    (``Engine.eos_token_ids`` reads and sets them)."""

    def __init__(self, pipeline: LogitsPipeline, eos_token_ids: frozenset[int]) -> None:
        self.pipeline, self.eos_token_ids = pipeline, eos_token_ids

    def on_logits(self, req: Request, label: str, logits: torch.Tensor) -> None:
        """A stream's last token is in: choose its sample's next token."""
        if label in GUIDED:
            req.pending[label] = logits
            if len(req.pending) < 2:
                return
            cond, uncond = req.pending.pop("cond"), req.pending.pop("uncond")
            logits = uncond + req.guidance_scale * (cond - uncond)
        sample = req.by_label[label]
        self._emit(req, sample, self._choose(req, sample, logits))

    def forked(self, req: Request, live: list[Sample], logits: torch.Tensor) -> None:
        """``req``'s prompt stream ``main`` was forked into the first stream of
        each sample in ``live``: each feeds its generated tokens on from the
        prompt; one with no token yet draws its first from ``logits``."""
        del req.streams["main"], req.fed["main"]
        for sample in live:
            label = sample.labels[0]
            req.streams[label], req.fed[label] = req.prompt + sample.token_ids, len(req.prompt)
            if not sample.token_ids:
                self._emit(req, sample, self._choose(req, sample, logits))

    def _choose(self, req: Request, sample: Sample, logits: torch.Tensor) -> int:
        return self.pipeline.choose(req, sample, logits)

    def _emit(self, req: Request, sample: Sample, token: int) -> None:
        """Append ``token`` to ``sample`` and its text; feed it next, unless it
        ends the sample (its streams are then dropped, and their pages released
        after the step). An EOS/stop token is not part of the text."""
        params, text = req.params, sample.text
        sample.token_ids.append(token)
        if token in params.stop_token_ids or (
            not params.ignore_eos and token in self.eos_token_ids
        ):
            sample.finish_reason = "stop"
            if text is not None:
                text.close()
        elif text is not None and text.add(token):
            sample.finish_reason = "stop"  # a stop string
        elif len(sample.token_ids) >= params.max_new_tokens:
            sample.finish_reason = "stop" if text is not None and text.close() else "length"
        for label in sample.labels:
            if sample.finish_reason is None:
                req.streams[label].append(token)
            else:
                req.streams.pop(label, None)
                req.fed.pop(label, None)
