"""moee: Mixture-of-Experts language models as free embedding models.

The public entry points are re-exported lazily so that `import moee` stays cheap
(torch and transformers load only when an embedder or trace is used). `import moee` makes every
model type moee defines (`moee_lm`, `moee_upcycled`, `deepseek`) loadable through the transformers
Auto classes: at once when transformers is already loaded, else the moment it is
(`moee.models.register_when_transformers_loads`).
"""

from __future__ import annotations

import os

from moee.models import register_when_transformers_loads

#: Compiled matmul kernels oneDNN (PyTorch's CPU backend for bfloat16 and float16) keeps, one per
#: matmul shape. Its default, 1024, holds 0.3-1.6 MB per shape, and every batch of different
#: length, and every expert's share of a batch's tokens, is a new shape: a bfloat16 run on the CPU
#: grew by about 1 GB over a few hundred batches (OLMoE widths) before the cache was full. Set
#: before torch's first bfloat16 matmul, unless the environment already sets it; recompiling an
#: evicted kernel cost no measurable time.
ONEDNN_PRIMITIVE_CACHE_CAPACITY = "64"
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", ONEDNN_PRIMITIVE_CACHE_CAPACITY)

__version__ = "0.1.0"

__all__ = ["MoEEmbedder", "RoutingTrace", "supported_architectures", "__version__"]


def __getattr__(name: str):
    if name in ("MoEEmbedder", "RoutingTrace"):
        from moee.embed import embedder

        return getattr(embedder, name)
    if name == "supported_architectures":
        from moee.capture.registry import supported_architectures

        return supported_architectures
    raise AttributeError(f"module 'moee' has no attribute {name!r}")


register_when_transformers_loads()
