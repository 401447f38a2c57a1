"""The Llama family's fused decoder layers on the CPU backend: q/k/v and
gate/up as one packed product (``fused_linear``), rotary embeddings, a
layer's attention over the plan (``attention``), one layer (``layer``), the
stack of them as one C++ call a decode step (``stack``) and the model's step
that picks between them (``step``). Imports ``mstar.cpu`` and the plan layer.
"""
