"""The logits pipeline: what a request asks for (``SamplingParams``,
``params``), penalties and logit bias, log-probabilities, grammars
(``structured``), speculative drafts and the pipeline that applies them to
a step's logits (``logits``).

Part of the serving loop: it may read the loop's requests
(``mstar.engine.request``) and the plan layer; nothing under ``mstar.models``
or ``mstar.cpu`` imports it.
"""

from mstar.engine.sampling.params import SamplingParams

__all__ = ["SamplingParams"]
