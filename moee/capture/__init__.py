"""Router capture: find every MoE router of a model and record its dense routing with hooks.

The names below are loaded lazily, so that ``moee.capture.vocabulary`` (the pooling and score names
the embed layer reads) can be imported without torch or transformers.
"""

from __future__ import annotations

import importlib

#: Public name -> the capture module that defines it.
_EXPORTS = {
    "ARCHITECTURES": "architectures",
    "DEFAULT_SCORE": "vocabulary",
    "MODEL_TYPE_RULES": "architectures",
    "ROUTER_CLASSES": "architectures",
    "RULES": "architectures",
    "SCORES": "vocabulary",
    "SELECTION_FORMATS": "architectures",
    "RouterSpec": "registry",
    "RoutingRecorder": "recorder",
    "apply_score": "architectures",
    "find_routers": "registry",
    "find_routers_by_pattern": "registry",
    "read_selection": "architectures",
    "router_report": "registry",
    "selection_scores": "architectures",
    "supported_architectures": "registry",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"moee.capture.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'moee.capture' has no attribute {name!r}")
