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

from moee.upcycle_settings import UpcycleSettings, router_options

__all__ = ["register", "router_options", "run"]


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "upcycle",
        help="dense checkpoint -> MoE model (experts copied from or split out of each FFN)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from moee.cli_options import add_field_arguments

    p.add_argument("src", help="dense model: a local directory or a Hugging Face name (safetensors)")
    add_field_arguments(p, UpcycleSettings, explicit=False)  # one flag per field
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Check every input, build the model, then write the folder (staged, committed by rename)."""
    from moee.cli_options import settings_of
    from moee.moe.upcycle import upcycle_to_folder

    settings = settings_of(UpcycleSettings, args)  # every flag checked here, before any loading
    model, out, tokenizer, sample = upcycle_to_folder(args.src, settings)
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
