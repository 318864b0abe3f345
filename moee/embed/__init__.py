"""Embeddings from MoE routing: the embedder, methods, prompts and input checks.

``MoEEmbedder``, ``RoutingTrace`` and ``TokenRoutes`` are loaded lazily, so importing
``moee.embed.methods`` or ``moee.embed.prompts`` does not import torch or transformers.
"""

from __future__ import annotations

__all__ = ["MoEEmbedder", "RoutingTrace", "TokenRoutes"]


def __getattr__(name: str):
    if name in __all__:
        from moee.embed import embedder

        return getattr(embedder, name)
    raise AttributeError(f"module 'moee.embed' has no attribute {name!r}")
