"""Native (no remote code) implementations of MoE architectures that transformers 5 lacks.

Importing a module here registers its ``model_type`` with the transformers Auto classes;
``moee.MoEEmbedder.from_pretrained`` does that for every module listed in :data:`NATIVE_MODEL_TYPES`.
"""

from __future__ import annotations

import importlib

__all__ = ["NATIVE_MODEL_TYPES", "register_native_models"]

#: model_type -> module that implements and registers it.
NATIVE_MODEL_TYPES: dict[str, str] = {"deepseek": "moee.models.deepseek_v1"}


def register_native_models() -> None:
    """Register every native architecture with ``AutoConfig`` / ``AutoModel(ForCausalLM)`` (idempotent)."""
    for module in NATIVE_MODEL_TYPES.values():
        importlib.import_module(module)
