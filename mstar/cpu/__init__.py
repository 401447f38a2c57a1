"""The CPU backend: every C++ source under ``csrc/``, their build (``build``,
cached under ``cachedir``), the packed weights and their kernels (``quant``,
the arena included), the fused layer's small ops' Python face
(``layer_ops``) and the host CPU as speed decisions name it (``info``).

It knows nothing of models or serving: it imports only the standard
library, torch and numpy. Everything above it (``mstar.models``,
``mstar.engine``, ``mstar.serve``) may import it.
"""
