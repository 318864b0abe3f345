"""moee ablate's loss and KL arithmetic runs in float32 a slice of logits at a time.

It made float32 copies of the whole batch's ``[B, T, V]`` logits (two for the losses, two for each
steering KL): with a bfloat16 model of a real vocabulary that is several times the logits the model
itself returns (1.2 GB per copy at batch 16 x 128 tokens and 152k ids). The sliced versions give
the same numbers, and a bfloat16 model's losses now need little beyond its own logits.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch.nn import functional as F

from moee.analysis import expert_importance as ei


def test_sliced_losses_and_kl_equal_the_whole_batch_formulas(monkeypatch):
    monkeypatch.setattr(ei, "LOSS_LOGITS", 7 * 1000)  # 7 positions a slice: rows split unevenly
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 20, 1000, generator=gen).to(torch.bfloat16)
    other = torch.randn(3, 20, 1000, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, 1000, (3, 20), generator=gen)
    whole = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none")
    torch.testing.assert_close(ei._next_token_nll(logits, ids), whole, atol=1e-6, rtol=1e-6)
    p, q = logits.float().log_softmax(-1), other.float().log_softmax(-1)
    torch.testing.assert_close(
        ei._kl_per_token(logits, other), (p.exp() * (p - q)).sum(-1), atol=1e-6, rtol=0
    )
    assert ei._next_token_nll(logits, ids).dtype == torch.float32


#: In a fresh process: a bfloat16 tiny OLMoE with a 32k vocabulary, one batch of 16 x 128 tokens
#: through _batch_losses; prints the logits' bytes and the resident high-water mark's growth.
PEAK = """
import torch
from moee.analysis.expert_importance import _batch_losses
from moee.capture.tiny import tiny_model
def status(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key + ":"))
model = tiny_model("olmoe", n_layers=1, vocab_size=32000).to(torch.bfloat16)
ids = torch.randint(4, 32000, (16, 128), generator=torch.Generator().manual_seed(0))
mask = torch.ones_like(ids)
with torch.inference_mode():
    _batch_losses(model, ids[:2, :8], mask[:2, :8])  # first-use costs
    before = status("VmRSS")
    _batch_losses(model, ids, mask)
print(16 * 128 * 32000 * 2, status("VmHWM") - before)
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_bfloat16_losses_need_little_beyond_the_models_own_logits():
    run = subprocess.run(
        [sys.executable, "-c", PEAK], capture_output=True, text=True, timeout=300, check=True
    )
    logits_bytes, growth = (int(x) for x in run.stdout.split())
    # the model's bf16 logits, its activations and the slices: well under the two float32 copies
    # (4x the logits) the whole-batch arithmetic made
    assert growth < 2.5 * logits_bytes, (growth / 1e6, logits_bytes / 1e6)
