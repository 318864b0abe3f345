"""Vocabulary surgery for small models: keep only the tokens a corpus uses, and a causal LM template.

A pretrained encoder's vocabulary is sized for the web (BERT: 30,522 WordPiece tokens, ~45% of
all-MiniLM-L6-v2's weights), while a small model trained on one corpus never sees most of it.
`trim_vocabulary` keeps a chosen set of token ids (special tokens always), renumbers them in their
old order and cuts the input embedding, the (tied) output embedding and its bias to match, so
every kept token has exactly the vector it had. Text whose words need a dropped token is still
tokenised (WordPiece falls back to shorter pieces) as long as single characters are kept, which
`keep_for_counts` guarantees.

`causal_template` makes a BERT-style tokenizer (WordPiece, or RoBERTa's byte-level BPE) behave
like a causal LM's: one ``[CLS]`` / ``<s>`` (the BOS) before the text and nothing after it, so
last-token pooling reads the text's own last token.

Trimming supports only WordPiece and WordLevel tokenizers: their vocabulary is a plain token -> id
table. BPE / Unigram models also hold merges or scores that would need rewriting.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np
import torch
from tokenizers import Tokenizer
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerFast

__all__ = ["causal_template", "check_trimmable", "keep_for_counts", "trim_vocabulary"]

_SUPPORTED = ("WordPiece", "WordLevel")


def _fast_spec(tokenizer: PreTrainedTokenizerFast) -> dict:
    """The tokenizers JSON of a fast tokenizer (any model type)."""
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise TypeError(f"a fast (tokenizers-backed) tokenizer is needed, got {type(tokenizer).__name__}")
    return json.loads(tokenizer.backend_tokenizer.to_str())


def _spec(tokenizer: PreTrainedTokenizerFast) -> dict:
    """The tokenizers JSON of a trimmable tokenizer (a plain token -> id vocabulary)."""
    spec = _fast_spec(tokenizer)
    kind = spec["model"]["type"]
    if kind not in _SUPPORTED:
        raise ValueError(f"vocabulary trimming supports {', '.join(_SUPPORTED)} tokenizers, not {kind}")
    return spec


def check_trimmable(tokenizer: PreTrainedTokenizerFast) -> None:
    """Raise unless ``tokenizer`` can be trimmed (fast, WordPiece or WordLevel): checked before any
    model is loaded, so a tokenizer that cannot be trimmed fails first."""
    _spec(tokenizer)


def _rebuild(tokenizer: PreTrainedTokenizerFast, spec: dict, **special: str) -> PreTrainedTokenizerFast:
    names = {
        k: getattr(tokenizer, k) for k in ("unk_token", "pad_token", "cls_token", "sep_token", "mask_token")
    }
    names.update(special)
    new = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        model_max_length=tokenizer.model_max_length,
        **{k: v for k, v in names.items() if v is not None},
    )
    return new


def keep_for_counts(tokenizer: PreTrainedTokenizerFast, counts: np.ndarray, min_count: int = 1) -> list[int]:
    """Token ids seen at least ``min_count`` times (``counts[id]``), plus every special token and
    every single-character token (bare or ``##``-continuation), so any text still tokenises."""
    spec = _spec(tokenizer)
    vocab: dict[str, int] = spec["model"]["vocab"]
    if len(counts) != len(vocab):
        raise ValueError(f"counts has {len(counts)} entries but the vocabulary has {len(vocab)} tokens")
    prefix = spec["model"].get("continuing_subword_prefix") or ""
    keep = set(np.flatnonzero(np.asarray(counts) >= min_count).tolist())
    keep |= set(tokenizer.all_special_ids)
    for token, idx in vocab.items():
        bare = token[len(prefix) :] if prefix and token.startswith(prefix) else token
        if len(bare) == 1:
            keep.add(idx)
    return sorted(keep)


@torch.no_grad()
def trim_vocabulary(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, keep: Sequence[int]
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast, torch.Tensor]:
    """Keep the token ids ``keep`` (plus special tokens), renumbered in their old order.

    Returns the model (modified in place: input/output embeddings, output bias and the configs'
    ``vocab_size`` and special token ids), a new tokenizer, and ``old_ids [n_new]`` (new id ->
    old id). A kept token's embedding, output row and bias are exactly the old ones.
    """
    spec = _spec(tokenizer)
    vocab: dict[str, int] = spec["model"]["vocab"]
    n_old = len(vocab)
    ids = sorted(set(int(i) for i in keep) | set(tokenizer.all_special_ids))
    if not ids or ids[0] < 0 or ids[-1] >= n_old:
        raise ValueError(f"token ids to keep must lie in [0, {n_old}), got {ids[:1]}..{ids[-1:]}")
    unk = spec["model"].get("unk_token")
    inverse = {i: t for t, i in vocab.items()}
    if unk is not None and vocab.get(unk) not in ids:
        raise ValueError(f"the unknown token {unk!r} must be kept")
    new_id = {old: new for new, old in enumerate(ids)}
    spec["model"]["vocab"] = {inverse[old]: new for old, new in new_id.items()}
    for added in spec.get("added_tokens") or []:
        added["id"] = new_id[added["id"]]
    post = spec.get("post_processor")
    if post and post.get("type") == "TemplateProcessing":
        for entry in post["special_tokens"].values():
            entry["ids"] = [new_id[i] for i in entry["ids"]]
    new_tokenizer = _rebuild(tokenizer, spec)

    old_ids = torch.tensor(ids)
    emb = model.get_input_embeddings()
    new_emb = nn.Embedding(len(ids), emb.weight.shape[1], padding_idx=None)
    new_emb.weight.copy_(emb.weight[old_ids])
    model.set_input_embeddings(new_emb)
    out = model.get_output_embeddings()
    if out is not None:
        new_out = nn.Linear(out.weight.shape[1], len(ids), bias=out.bias is not None)
        new_out.weight.copy_(out.weight[old_ids])
        if out.bias is not None:
            new_out.bias.copy_(out.bias[old_ids])
        if out.weight is emb.weight:
            new_out.weight = new_emb.weight  # keep the tie
        model.set_output_embeddings(new_out)
    configs = [model.config] + [c for c in (getattr(model.config, "text_config", None),) if c is not None]
    for cfg in configs:
        cfg.vocab_size = len(ids)
        for key in ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "cls_token_id"):
            value = getattr(cfg, key, None)
            if isinstance(value, int):
                setattr(cfg, key, new_id.get(value))
    return model, new_tokenizer, old_ids


def causal_template(
    tokenizer: PreTrainedTokenizerFast, bos: str | None = None, eos: str | None = None
) -> PreTrainedTokenizerFast:
    """A copy of a BERT- or RoBERTa-style fast tokenizer that adds only ``bos`` (default its CLS token) before a text
    and nothing after, with ``bos_token`` / ``eos_token`` set (default EOS: its SEP token), as a
    causal LM's tokenizer does. Documents in training are separated by the EOS token."""
    spec = _fast_spec(tokenizer)  # the template is model-independent: WordPiece, BPE, ... alike
    bos = bos or tokenizer.cls_token
    eos = eos or tokenizer.sep_token
    if bos is None or eos is None:
        raise ValueError("the tokenizer has no CLS/SEP tokens: pass bos= and eos=")
    vocab = tokenizer.get_vocab()
    for token in (bos, eos):
        if token not in vocab:
            raise ValueError(f"{token!r} is not in the vocabulary")
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [
            {"SpecialToken": {"id": bos, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": eos, "type_id": 0}},
            {"Sequence": {"id": "B", "type_id": 0}},
        ],
        "special_tokens": {
            bos: {"id": bos, "ids": [vocab[bos]], "tokens": [bos]},
            eos: {"id": eos, "ids": [vocab[eos]], "tokens": [eos]},
        },
    }
    return _rebuild(tokenizer, spec, bos_token=bos, eos_token=eos)
