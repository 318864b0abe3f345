"""Shared tiny-model fixtures, built with ``moee.capture.tiny`` (no download, fixed seed).

The embedder and the saved checkpoint are session-scoped: tests only read them. The bare model is
module-scoped, because tests attach hooks to it (and check that they are removed again).
"""

from __future__ import annotations

import pytest
import torch

from moee.capture.tiny import tiny_model, tiny_tokenizer
from moee.embed.embedder import MoEEmbedder

# A test marked ``all_architectures`` is parametrized over every supported architecture (``model_type``).
# The full suite (plain ``pytest``, as CI runs it) checks them all; the quick loop (``-m "not slow"``)
# keeps two representatives: a softmax router and a sigmoid router with a selection-only bias.
QUICK_ARCHITECTURES = ("olmoe", "deepseek_v3")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every architecture but the quick representatives slow, before ``-m`` deselects."""
    for item in items:
        if item.get_closest_marker("all_architectures") is None:
            continue
        callspec = getattr(item, "callspec", None)
        if callspec is None or callspec.params.get("model_type") not in QUICK_ARCHITECTURES:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module")
def tiny_olmoe() -> torch.nn.Module:
    """A 2-layer tiny random OLMoE in eval mode (8 experts, top-2)."""
    return tiny_model("olmoe", n_layers=2)


@pytest.fixture(scope="session")
def tiny_embedder() -> MoEEmbedder:
    """A ``MoEEmbedder`` over the tiny OLMoE and the word-level tiny tokenizer."""
    return MoEEmbedder(tiny_model("olmoe", n_layers=2), tiny_tokenizer())


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """The tiny OLMoE and its tokenizer saved like a hub checkpoint (the same weights as ``tiny_embedder``)."""
    path = tmp_path_factory.mktemp("tiny-olmoe")
    tiny_model("olmoe", n_layers=2).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)
