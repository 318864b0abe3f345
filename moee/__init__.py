"""moee: Mixture-of-Experts language models as free embedding models.

The public entry points are re-exported lazily so that `import moee` stays cheap
(torch and transformers load only when an embedder or trace is used). `import moee` makes every
model type moee defines (`moee_lm`, `moee_upcycled`, `deepseek`) loadable through the transformers
Auto classes: at once when transformers is already loaded, else the moment it is
(`moee.models.register_when_transformers_loads`).
"""

from __future__ import annotations

from moee.models import register_when_transformers_loads

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
