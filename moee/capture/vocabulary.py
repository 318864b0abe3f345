"""The names capture understands: how tokens are pooled and how router logits are scored.

Capture owns this vocabulary because it implements it (:mod:`moee.capture.recorder` pools,
:mod:`moee.capture.architectures` scores); the embed layer above reads it from here (and
re-exports it from ``moee.embed.methods``). Plain tuples and strings, so importing them loads
neither torch nor transformers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["DEFAULT_SCORE", "POOLINGS", "SCORES", "check_choice"]

#: Poolings of a text's tokens into one HS / RW row (``moee.capture.recorder`` adds ``"tokens"``,
#: which keeps every token and is not an embedding).
POOLINGS = ("last", "mean")
#: How router logits become RW (see ``moee.capture.architectures``): ``native`` is the architecture's
#: own scoring rule over all experts (softmax for softmax routers such as OLMoE, Qwen-MoE and Mixtral;
#: sigmoid for DeepSeek-V3-style and Llama-4 routers), ``softmax`` the dense softmax of the logits
#: for every architecture (the paper's formula for g^(l)), ``selection`` what the router ranks to
#: pick its top-k (selection-only biases and group limits included), ``logits`` the raw logits.
SCORES = ("native", "softmax", "selection", "logits")
#: The score every API, CLI command and evaluation uses unless told otherwise: the scores the model
#: itself computes (equal to ``softmax`` for softmax routers, so the paper's models are unchanged).
DEFAULT_SCORE = "native"


def check_choice(kind: str, value: Any, allowed: Sequence[str]) -> str:
    """Return ``value`` if it is one of ``allowed``, else raise ``ValueError`` listing them: the one
    check of a name (a pooling, a score, a method, ...), so every entry point words it the same."""
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"unknown {kind} {value!r}; expected one of: {', '.join(allowed)}")
    return value
