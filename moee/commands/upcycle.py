"""`moee upcycle`: build an MoE model from a dense Hugging Face checkpoint (docs/UPCYCLING.md).

``--mode copy`` copies each FFN into every expert (sparse upcycling); ``--mode split`` partitions
each FFN's neurons into equal-size experts by balanced k-means (MoEfication). The output directory
holds safetensors weights, the config (``model_type: moee_upcycled``) and the source tokenizer;
it loads with the transformers Auto classes after ``import moee``, with
``moee.MoEEmbedder.from_pretrained`` and every command's ``--model``. ``--router`` is any gate
of the registry the from-scratch LM uses (``moee.moe.gate_registry.GATES``), its other fields
``--router-option KEY=VALUE``.

Every input is checked before the dense model loads (``--out``, the numbers, the router options,
the ``--trim-vocab`` corpus, the tokenizer). The folder is written under a unique hidden name beside
``--out`` and renamed into place when complete: a killed run leaves no ``--out`` that looks
finished. ``--overwrite`` replaces the files of the previous model in ``--out`` (no stale tokenizer
stays) and keeps every other file there; an ``--out`` that is, holds or lies inside SRC or a
corpus is refused, with or without it.
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
    p.add_argument(
        "--mode",
        choices=("split", "copy", "lora"),
        default="split",
        help="split: experts partition each FFN's neurons; copy: every expert a copy of the FFN; lora: "
        "the FFN shared, each expert a low-rank adapter of its down projection (default %(default)s)",
    )
    p.add_argument(
        "--lora-rank",
        type=int,
        default=8,
        help="lora: the rank of each expert's adapter (default %(default)s)",
    )
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
        help="router start: centroids of the FFN's neuron clusters (split, lora), random normal, or "
        "zero (default: centroid for split and lora, random for copy)",
    )
    p.add_argument(
        "--router-std", type=float, default=0.02, help="std of a random router (default %(default)s)"
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="every random draw: k-means starts, random routers, weights the checkpoint lacks "
        "(an encoder's new LM head) (default %(default)s)",
    )
    p.add_argument(
        "--calibrate",
        default=None,
        metavar="CORPUS.jsonl",
        help="texts ({'text': ...} per line; the first 256 are read) the routers are balanced on "
        "(the first three quarters) and their start load measured on (the last quarter); text like "
        "the model's training text balances best (default: the --trim-vocab corpus, else the "
        "documents of nine kinds shipped with the bundled model)",
    )
    p.add_argument(
        "--no-router-balance",
        action="store_true",
        help="keep the raw router start (by default every router has the shared component of its "
        "layer's inputs removed and per-expert offsets settled, so the experts start evenly loaded)",
    )
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
    p.add_argument(
        "--router",
        choices=_GateNames(),
        metavar="GATE",  # a metavar keeps argparse from listing the choices (importing torch) at start-up
        default="loss_free",
        help="the gate: %(choices)s (moee.moe.gate_registry.GATES, as in moee train's model.router_type) "
        "(default %(default)s: top-k softmax with a selection bias that keeps the load balanced while "
        "the model trains; untrained it computes what noisy_top_k without noise, the deterministic "
        "top-k, does)",
    )
    p.add_argument(
        "--router-bias-gamma", type=float, default=1e-3, help="loss-free bias step (default %(default)s)"
    )
    p.add_argument(
        "--router-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another router_* field of the gate (repeatable), VALUE parsed by the field's type: "
        "true/false for a bool, an integer, a finite number, null where the field may be unset; e.g. "
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
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a non-empty --out folder: the previous model's files there are replaced, "
        "a user's other files stay",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Check every input, build the model, then write the folder (staged, committed by rename)."""
    import torch

    from moee.moe.upcycle import calibration_texts, save_upcycled, upcycle

    order = check_inputs(args)
    tokenizer_from = _tokenizer_source(args.src)
    if tokenizer_from is None and (args.trim_vocab or args.calibrate):
        raise ValueError(f"--trim-vocab / --calibrate need the tokenizer of {args.src}, and it has none")
    tokenizer = None
    if tokenizer_from is not None:  # loaded (and checked) before the model
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    if args.trim_vocab:
        from moee.moe.vocab import check_trimmable

        check_trimmable(tokenizer)
    calibration = mask = None
    source = args.calibrate or args.trim_vocab
    texts = calibration_texts(corpus=source) if source else None
    if texts:
        enc = tokenizer(texts, padding=True, truncation=True, max_length=32, return_tensors="pt")
        calibration, mask = enc["input_ids"], enc["attention_mask"]
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
        balance_router=not args.no_router_balance,
        calibration=calibration,
        calibration_mask=mask,
        tokenizer=tokenizer,
        lora_rank=args.lora_rank,
    )
    if tokenizer is not None and (args.trim_vocab or args.causal):
        tokenizer = _adapt_tokenizer(model, tokenizer, args)
    out = save_upcycled(model, args.out, tokenizer=tokenizer, overwrite=args.overwrite, inputs=_inputs(args))
    cfg = model.config
    print(
        f"wrote {out}: {cfg.text_config.model_type} -> {len(model.moe_ffns())} MoE layers x "
        f"{cfg.num_experts} experts (top-{cfg.num_experts_per_tok}, {cfg.upcycle_mode}, "
        f"expert width {cfg.expert_intermediate_size}, shared width {cfg.shared_intermediate_size}, "
        f"router {cfg.router_init}/{cfg.router_type}, vocabulary {model.get_input_embeddings().weight.shape[0]})"
    )
    if tokenizer is None:
        print(
            f"note: {args.src} has no tokenizer, so {out} has none either: save the tokenizer there yourself"
        )
    report = model.router_load_report
    if source:
        sample = f"the first {len(texts)} texts of {source}"
    elif tokenizer is not None:
        sample = (
            "256 documents of nine kinds shipped with moee (--calibrate CORPUS.jsonl balances on your text)"
        )
    else:
        sample = "seeded random token ids (the model has no tokenizer)"
    print(f"calibration sample: {sample}")
    print(
        f"router start load per layer on the last quarter of the calibration sample, which the "
        f"balancing did not see (max/mean, ceiling "
        f"{report[0]['ceiling']:.2f} = experts / top-k; dead experts):"
    )
    for layer in report:
        flag = "  COLLAPSED" if layer["collapsed"] else ""
        print(f"  layer {layer['layer']}: max/mean {layer['max_over_mean']:.2f}, {layer['dead']} dead{flag}")
    return 0


def check_inputs(args: argparse.Namespace) -> list[int] | None:
    """Every check that needs no model, before any loading: ``--out`` (a folder, empty or
    ``--overwrite``, writable, not an input nor holding or inside one), the numbers,
    ``--router-option``, ``--trim-vocab``'s corpus (read through once: every line a JSON object
    with a string ``text``). Returns the layer order."""
    import math

    from moee.io import check_output_folder
    from moee.moe.upcycle import UPCYCLED_OUTPUT

    order = None
    if args.layer_order is not None:
        if not args.layer_order.strip():
            raise ValueError(
                "--layer-order is empty: give the dense layers to stack, e.g. --layer-order 0,1,2,3,2,3, "
                "or leave the flag out to keep the dense model's layers as they are"
            )
        try:
            order = [int(x) for x in args.layer_order.split(",")]
        except ValueError:
            raise ValueError(
                f"--layer-order must be comma-separated integers, got {args.layer_order!r}"
            ) from None
        if any(i < 0 for i in order):
            raise ValueError(f"--layer-order takes layer indices >= 0, got {args.layer_order!r}")
    check_output_folder(args.out, overwrite=args.overwrite, inputs=_inputs(args), output=UPCYCLED_OUTPUT)
    for flag, value in (("--router-std", args.router_std), ("--router-bias-gamma", args.router_bias_gamma)):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{flag} must be a finite number >= 0, got {value}")
    for flag, value, low in (
        ("--experts", args.experts, 1),
        ("--top-k", args.top_k, 1),
        ("--min-count", args.min_count, 1),
    ):
        if value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    if args.shared_neurons < 0:
        raise ValueError(f"--shared-neurons must be >= 0, got {args.shared_neurons}")
    router_options(args.router_option)
    if args.trim_vocab:
        _check_corpus(args.trim_vocab, "--trim-vocab corpus")
    elif args.min_count != 1:
        raise ValueError("--min-count applies to --trim-vocab only")
    if args.calibrate:
        _check_corpus(args.calibrate, "--calibrate corpus")
    return order


def _inputs(args: argparse.Namespace) -> dict[str, str | None]:
    """What the command reads, by flag: ``--out`` may be none of them, hold none, lie inside none."""
    return {"SRC": args.src, "--calibrate": args.calibrate, "--trim-vocab": args.trim_vocab}


def _check_corpus(path: str, what: str) -> None:
    """Read ``path`` through once: every line a JSON object with a string ``text``, at least one."""
    from moee.io import check_input_file, iter_jsonl

    corpus = check_input_file(path, what)
    n = 0
    for line, row in iter_jsonl(corpus):
        if not isinstance(row.get("text"), str):
            raise ValueError(f"{corpus}:{line}: needs a string 'text' field")
        n += 1
    if n == 0:
        raise ValueError(f"{what} {corpus} holds no texts")


def _tokenizer_source(src: str) -> str | None:
    """Where the source's tokenizer is read from: ``src`` itself when it is a folder holding one
    or a Hub name, else ``None``."""
    from pathlib import Path

    path = Path(src)
    if not path.exists():
        return src
    has = path.is_dir() and any(
        (path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt")
    )
    return src if has else None


def router_options(pairs: list[str]) -> dict:
    """``--router-option KEY=VALUE`` pairs as config fields, each VALUE parsed by its field's type
    (`moee.moe.gate_registry.parse_router_option`); a value that does not parse, unknown keys
    or a key given twice are an error naming the option, before any loading."""
    from moee.moe.gate_registry import parse_router_option, router_option_types

    known = router_option_types()
    texts: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--router-option must be KEY=VALUE, got {pair!r}")
        if key in texts:
            raise ValueError(f"--router-option {key} is given twice; give each option once")
        texts[key] = value
    unknown = sorted(k for k in texts if k not in known)
    if unknown:
        raise ValueError(f"unknown router option(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return {key: parse_router_option(key, value, what="--router-option") for key, value in texts.items()}


def _adapt_tokenizer(model, tokenizer, args: argparse.Namespace):
    """The tokenizer to save: trimmed to ``--trim-vocab``'s tokens (the model's embeddings too) and,
    for an encoder made causal, with a BOS-only template (any fast tokenizer: WordPiece for BERT,
    byte-level BPE for RoBERTa; only trimming needs a WordPiece / WordLevel vocabulary)."""
    import numpy as np

    from moee.io import iter_jsonl
    from moee.moe.upcycled import family_rule
    from moee.moe.vocab import causal_template, keep_for_counts, trim_vocabulary

    if args.trim_vocab:
        from tqdm.auto import tqdm

        counts = np.zeros(len(tokenizer), dtype=np.int64)
        batch: list[str] = []

        def flush() -> None:
            for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
                counts[:] += np.bincount(ids, minlength=len(counts))[: len(counts)]
            batch.clear()

        for _, row in tqdm(iter_jsonl(args.trim_vocab), desc="count tokens", unit=" docs"):
            batch.append(row["text"])  # every row was checked by check_inputs
            if len(batch) >= 1000:
                flush()
        flush()
        keep = keep_for_counts(tokenizer, counts, args.min_count)
        model, tokenizer, _ = trim_vocabulary(model, tokenizer, keep)
    if args.causal and not family_rule(model.config.text_config.model_type).decoder:
        tokenizer = causal_template(tokenizer)
    return tokenizer


class _GateNames:
    """The ``--router`` choices: the names of ``moee.moe.gate_registry.GATES``, read only when argparse
    checks a value or prints them (the registry imports torch; ``moee --help`` must not)."""

    def _names(self) -> tuple[str, ...]:
        from moee.moe.gate_registry import GATES

        return tuple(GATES)

    def __contains__(self, name: object) -> bool:
        return name in self._names()

    def __iter__(self):
        return iter(self._names())
