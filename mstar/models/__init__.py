"""A model in, a forward out: loading (GGUF files, Hugging Face folders), the
dtype and device choices, the compiled forward, the Hugging Face attention
hook that runs a transformers decoder through the plan (``hf``), the fused
decoder layers per family (``llama``) and tensor parallelism (``tp``).

It may import ``mstar.cpu`` and the plan layer (``mstar.engine.resources``),
never the serving loop (``mstar.engine``'s other modules) or ``mstar.serve``.
"""
