"""Training the byte-level BPE tokenizer of the bundled model with the ``tokenizers`` library.

Byte-level BPE never produces unknown tokens, so any text (code, accents, emoji) can be embedded.
``<|endoftext|>`` is bos, eos and the document separator; ``<|pad|>`` pads on the left, which
last-token pooling needs. No special tokens are added automatically when encoding: the trainer
appends eos between packed documents, and the embedder decides about prompts.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN)


def train_tokenizer(
    texts: Iterable[str],
    *,
    vocab_size: int = 8192,
    min_frequency: int = 2,
    length: int | None = None,
    show_progress: bool = False,
):
    """Train a byte-level BPE on ``texts``; returns a ``PreTrainedTokenizerFast``.

    ids 0 and 1 are ``<|endoftext|>`` and ``<|pad|>``; then the 256 byte symbols, then merges.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < len(SPECIAL_TOKENS) + 256 + 1:
        raise ValueError(f"vocab_size must exceed the 256 byte symbols plus special tokens, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=None,
        pad_token=PAD_TOKEN,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=1024,
    )
    return fast


def iter_texts(path: str | Path) -> Iterator[str]:
    """The ``text`` field of each record of a corpus JSONL file."""
    from moee_build.corpus import iter_corpus

    for rec in iter_corpus(path):
        yield rec["text"]
