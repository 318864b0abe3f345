"""Per-text embeddings for every supported architecture: a text's vector does not depend on its batch.

Runs the full ``encode`` path (left padding, position ids from the mask, length-sorted batches) on
each tiny architecture, including hybrids with Mamba / linear-attention layers whose state could
otherwise absorb padding.
"""

from __future__ import annotations

import numpy as np
import pytest

from moee.capture import supported_architectures
from moee.capture.registry import MODEL_TYPE_RULES
from moee.capture.tiny import tiny_model, tiny_tokenizer
from moee.embed.embedder import MoEEmbedder
from moee.embed.methods import DEFAULT_SCORE

TEXTS = [
    "the cat sat on the mat",
    "a dog ran under the big green tree",
    "music",
    "",
    "the quick bird flew over the river at night while the sun sat on the mountain",
    "rain",
]


@pytest.mark.slow
@pytest.mark.parametrize("model_type", supported_architectures())
def test_encode_is_batch_invariant(model_type):
    emb = MoEEmbedder(tiny_model(model_type), tiny_tokenizer())
    for method in ("hs", "rw"):
        alone = np.stack([emb.encode([t], method=method)[0] for t in TEXTS])
        batched = emb.encode(TEXTS, method=method, batch_size=7)
        assert np.abs(batched - alone).max() <= 1e-5, method
        assert np.isfinite(batched).all()


SOFTMAX_RULES = ("softmax", "topk_softmax", "softmax_bias")  # the rules whose native scores are the softmax
SOFTMAX_ROUTERS = [m for m in supported_architectures() if MODEL_TYPE_RULES[m] in SOFTMAX_RULES]
OTHER_ROUTERS = [m for m in supported_architectures() if m not in SOFTMAX_ROUTERS]


@pytest.mark.all_architectures
@pytest.mark.parametrize("model_type", SOFTMAX_ROUTERS)
def test_default_score_is_softmax_for_softmax_routers(model_type):
    """The paper's models (softmax routers) get exactly the paper's RW from the default score."""
    emb = MoEEmbedder(tiny_model(model_type), tiny_tokenizer())
    default = emb.trace(TEXTS)
    assert default.score == DEFAULT_SCORE == "native"
    np.testing.assert_array_equal(default.rw, emb.trace(TEXTS, score="softmax").rw)


@pytest.mark.all_architectures
@pytest.mark.parametrize("model_type", OTHER_ROUTERS)
def test_default_score_is_the_architectures_own_rule(model_type):
    """For sigmoid, sqrt-softplus and sparsemixer routers the default RW is their own scores, not a softmax."""
    emb = MoEEmbedder(tiny_model(model_type), tiny_tokenizer())
    default = emb.trace(TEXTS).rw
    np.testing.assert_array_equal(default, emb.trace(TEXTS, score="native").rw)
    assert np.abs(default - emb.trace(TEXTS, score="softmax").rw).max() > 1e-3
