"""`moee upcycle`: build an MoE model from a dense Hugging Face checkpoint (docs/UPCYCLING.md).

``--mode copy`` copies each FFN into every expert (sparse upcycling); ``--mode split`` partitions
each FFN's neurons into equal-size experts by balanced k-means (MoEfication). The output directory
holds safetensors weights, the config (``model_type: moee_upcycled``) and the source tokenizer;
it loads with the transformers Auto classes after ``import moee``, with
``moee.MoEEmbedder.from_pretrained`` and every command's ``--model``. ``--router`` is any gate
of the registry the from-scratch LM uses (``moee.moe.gate_registry.GATES``), its other fields
``--router-option KEY=VALUE``.
"""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "upcycle",
        help="dense checkpoint -> MoE model (experts copied from or split out of each FFN)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("src", help="dense model: a local directory or a Hugging Face name (safetensors)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--experts", type=int, required=True, help="routed experts per layer")
    p.add_argument("--top-k", type=int, required=True, help="experts selected per token")
    p.add_argument("--mode", choices=("split", "copy"), default="split", help="(default %(default)s)")
    p.add_argument(
        "--shared-neurons",
        type=int,
        default=0,
        metavar="N",
        help="split: keep N neurons always on as a shared expert (default %(default)s)",
    )
    p.add_argument(
        "--shared-select",
        choices=("norm", "central"),
        default="norm",
        help="split: which neurons are shared: largest weight norm, or most central direction",
    )
    p.add_argument("--shared-copy", action="store_true", help="copy: add an always-on copy of the FFN")
    p.add_argument(
        "--router-init",
        choices=("centroid", "random", "zero"),
        default=None,
        help="router start: cluster centroids (split only), random normal, or zero "
        "(default: centroid for split, random for copy)",
    )
    p.add_argument(
        "--router-std", type=float, default=0.02, help="std of a random router (default %(default)s)"
    )
    p.add_argument("--seed", type=int, default=0, help="k-means / router seed (default %(default)s)")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="load and save in this dtype",
    )
    p.add_argument(
        "--causal",
        action="store_true",
        help="encoders (BERT, RoBERTa): make a causal LM (causal attention, LM head tied to the "
        "embeddings, tokenizer adds only a leading CLS as BOS)",
    )
    p.add_argument(
        "--layer-order",
        default=None,
        metavar="I,J,...",
        help="depth up-scaling first: the new layer list as old layer indices, e.g. 0,1,2,3,2,3,4,5",
    )
    from moee.moe.gate_registry import GATES

    p.add_argument(
        "--router",
        choices=tuple(GATES),
        default="noisy_top_k",
        help="the gate, any of moee.moe.gate_registry.GATES, as in moee train's model.router_type "
        "(default %(default)s, without noise: deterministic top-k; loss_free: top-k with a "
        "loss-free balancing bias)",
    )
    p.add_argument(
        "--router-bias-gamma", type=float, default=1e-3, help="loss-free bias step (default %(default)s)"
    )
    p.add_argument(
        "--router-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another router_* field of the gate (repeatable; VALUE is JSON, else a string), e.g. "
        "router_n_groups=4 for hierarchical (moee/moe/README_TRAINING.md lists them)",
    )
    p.add_argument(
        "--trim-vocab",
        default=None,
        metavar="CORPUS.jsonl",
        help="keep only tokens seen in this JSONL corpus ({'text': ...} per line), plus special and "
        "single-character tokens (WordPiece/WordLevel tokenizers)",
    )
    p.add_argument(
        "--min-count",
        type=int,
        default=1,
        help="--trim-vocab: times a token must occur (default %(default)s)",
    )
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty --out directory")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from moee.moe.upcycle import save_upcycled, upcycle

    order = None
    if args.layer_order:
        try:
            order = [int(x) for x in args.layer_order.split(",")]
        except ValueError:
            raise ValueError(
                f"--layer-order must be comma-separated integers, got {args.layer_order!r}"
            ) from None

    out_dir = Path(args.out)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not args.overwrite:
        raise FileExistsError(
            f"{out_dir} exists and is not an empty directory; pass --overwrite to write into it"
        )
    model = upcycle(
        args.src,
        n_experts=args.experts,
        top_k=args.top_k,
        mode=args.mode,
        shared_neurons=args.shared_neurons,
        shared_select=args.shared_select,
        shared_copy=args.shared_copy,
        router_init=args.router_init,
        router_std=args.router_std,
        seed=args.seed,
        dtype=getattr(torch, args.dtype) if args.dtype else None,
        causal=args.causal,
        layer_order=order,
        router_type=args.router,
        router_bias_gamma=args.router_bias_gamma,
        router_options=router_options(args.router_option),
    )
    has_tokenizer = Path(args.src).is_dir() and any(
        (Path(args.src) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt")
    )
    tokenizer_from = args.src if has_tokenizer or not Path(args.src).exists() else None
    tokenizer = None
    if args.trim_vocab or args.causal:
        if tokenizer_from is None:
            raise ValueError(f"--trim-vocab / --causal need the tokenizer of {args.src}, and it has none")
        tokenizer = _adapt_tokenizer(model, tokenizer_from, args)
    out = save_upcycled(
        model, args.out, tokenizer_from=None if tokenizer else tokenizer_from, tokenizer=tokenizer
    )
    cfg = model.config
    print(
        f"wrote {out}: {cfg.text_config.model_type} -> {len(model.moe_ffns())} MoE layers x "
        f"{cfg.num_experts} experts (top-{cfg.num_experts_per_tok}, {cfg.upcycle_mode}, "
        f"expert width {cfg.expert_intermediate_size}, shared width {cfg.shared_intermediate_size}, "
        f"router {cfg.router_init}/{cfg.router_type}, vocabulary {model.get_input_embeddings().weight.shape[0]})"
    )
    return 0


def router_options(pairs: list[str]) -> dict:
    """``--router-option KEY=VALUE`` pairs as config fields (a JSON value, else the string)."""
    import json

    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--router-option must be KEY=VALUE, got {pair!r}")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options


def _adapt_tokenizer(model, tokenizer_from: str, args: argparse.Namespace):
    """The tokenizer to save: trimmed to ``--trim-vocab``'s tokens (the model's embeddings too) and,
    for an encoder made causal, with a BOS-only template."""
    import numpy as np
    from transformers import AutoTokenizer

    from moee.io import iter_jsonl
    from moee.moe.upcycled import family_rule
    from moee.moe.vocab import causal_template, keep_for_counts, trim_vocabulary

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    if args.trim_vocab:
        from tqdm.auto import tqdm

        counts = np.zeros(len(tokenizer), dtype=np.int64)
        batch: list[str] = []

        def flush() -> None:
            for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
                counts[:] += np.bincount(ids, minlength=len(counts))[: len(counts)]
            batch.clear()

        for line, row in tqdm(iter_jsonl(args.trim_vocab), desc="count tokens", unit=" docs"):
            if not isinstance(row.get("text"), str):
                raise ValueError(f"{args.trim_vocab}:{line}: needs a string 'text' field")
            batch.append(row["text"])
            if len(batch) >= 1000:
                flush()
        flush()
        keep = keep_for_counts(tokenizer, counts, args.min_count)
        model, tokenizer, _ = trim_vocabulary(model, tokenizer, keep)
    if args.causal and not family_rule(model.config.text_config.model_type).decoder:
        tokenizer = causal_template(tokenizer)
    return tokenizer
