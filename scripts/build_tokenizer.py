#!/usr/bin/env python
"""Train the byte-level BPE tokenizer (vocab 8192) on build/corpus/train.jsonl and save it as a
transformers PreTrainedTokenizerFast in build/tokenizer/ (eos = bos = <|endoftext|>, pad = <|pad|>,
left padding).

    python scripts/build_tokenizer.py [--corpus build/corpus/train.jsonl] [--out build/tokenizer] [--vocab-size 8192]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # moee_build lives in the checkout, not in the installed package

from moee_build.corpus import iter_corpus  # noqa: E402
from moee_build.tokenizer import iter_texts, train_tokenizer  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=Path("build/corpus/train.jsonl"))
    ap.add_argument("--heldout", type=Path, default=Path("build/corpus/heldout.jsonl"))
    ap.add_argument("--out", type=Path, default=Path("build/tokenizer"))
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--min-frequency", type=int, default=2)
    args = ap.parse_args(argv)
    if not args.corpus.exists():
        raise SystemExit(f"{args.corpus} not found; run scripts/build_corpus.py first")
    t0 = time.time()
    n = sum(1 for _ in iter_corpus(args.corpus))
    tok = train_tokenizer(
        iter_texts(args.corpus), vocab_size=args.vocab_size, min_frequency=args.min_frequency, length=n
    )
    args.out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(args.out)
    stats = {"vocab_size": len(tok), "train_records": n, "seconds": round(time.time() - t0, 1)}
    for split, path in (("train", args.corpus), ("heldout", args.heldout)):
        if path.exists():
            texts = list(iter_texts(path))
            n_tok = sum(
                len(enc.ids) for enc in tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
            )
            n_chars = sum(len(t) for t in texts)
            stats[f"{split}_tokens"] = n_tok
            stats[f"{split}_chars_per_token"] = round(n_chars / max(n_tok, 1), 3)
    (args.out / "tokenizer_stats.json").write_text(json.dumps(stats, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(stats, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
