"""Per-text embeddings for every supported architecture: a text's vector does not depend on its batch.

Runs the full ``encode`` path (left padding, position ids from the mask, length-sorted batches) on
each tiny architecture, including hybrids with Mamba / linear-attention layers whose state could
otherwise absorb padding.
"""

from __future__ import annotations

import numpy as np
import pytest

from moee.capture import supported_architectures
from moee.capture.tiny import tiny_model, tiny_tokenizer
from moee.embed.embedder import MoEEmbedder

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
