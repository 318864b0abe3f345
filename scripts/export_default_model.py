"""Export a training checkpoint as the bundled default model, with its model card.

    python scripts/export_default_model.py --run build/train_default \
        --config configs/default_model.json --out moee/assets/default-model

Writes into --out: the model (config.json + model.safetensors, float32), the tokenizer, a
training-curve figure (training_curve.png), metrics.json (every figure in the card, with
versions and the command) and README.md (the model card: data sources and licences, config,
held-out perplexity next to an add-one unigram baseline, per-layer CV(load) and max/mean load
on held-out text in eval mode, training throughput). It also writes the throughput note
docs/bench_training.md unless --no-bench-note is given.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _versions() -> dict:
    from moee.provenance import package_versions

    return package_versions(("moee", "torch", "transformers", "tokenizers"), omit_missing=())


def _utc() -> str:
    from moee.provenance import utc_timestamp

    return utc_timestamp(zulu=True)


def read_log(path: Path) -> list[dict]:
    from moee.io import iter_jsonl

    if not path.exists():
        return []
    return [record for _, record in iter_jsonl(path)]


def plot_curve(log: list[dict], unigram_loss: float, out: Path) -> None:
    """Training loss (smoothed), held-out loss and the unigram baseline against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    train = [r for r in log if r["kind"] == "train"]
    evals = [r for r in log if r["kind"] == "eval"]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        steps = np.array([r["step"] for r in train])
        loss = np.array([r["lm_loss"] for r in train])
        win = max(1, min(25, len(loss) // 10))
        smooth = np.convolve(loss, np.ones(win) / win, mode="valid")
        ax.plot(steps, loss, color="0.8", lw=0.6, label="train LM loss (per step)")
        ax.plot(steps[win - 1 :], smooth, color="C0", lw=1.5, label=f"train LM loss ({win}-step mean)")
    if evals:
        ax.plot(
            [r["step"] for r in evals],
            [r["loss"] for r in evals],
            "o-",
            color="C1",
            ms=3,
            label="held-out loss",
        )
    ax.axhline(unigram_loss, color="C3", ls="--", lw=1, label=f"unigram baseline ({unigram_loss:.2f})")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("moee default model: training curve")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def _fmt_int(n: float) -> str:
    return f"{int(round(n)):,}"


def _routing_row(cfg: dict) -> str:
    k = cfg["num_experts_per_tok"]
    if cfg["router_type"] == "noisy_top_k":
        noise = "noisy" if cfg["router_noisy"] else "noise-free"
        return f"Shazeer {noise} top-{k} gate (softmax over the kept logits), zero-initialised W_g / W_noise"
    return (
        f"top-{k} of {cfg['router_score_func']} scores + a per-expert selection bias; gate weights = "
        "unbiased scores of the chosen experts, renormalised"
    )


def _balancing_row(cfg: dict, optim: dict) -> str:
    if cfg["router_type"] == "noisy_top_k":
        return (
            f"importance and load CV² losses, w_importance = {cfg['router_w_importance']}, "
            f"w_load = {cfg['router_w_load']} (Shazeer et al. 2017)"
        )
    return (
        f"auxiliary-loss-free bias (DeepSeek-V3 rule b_i += gamma * sign(mean load - load_i) after every "
        f"step, gamma = {cfg['router_bias_gamma']}); router lr x {optim.get('router_lr_scale', 1.0)}; "
        f"embedding multiplier {cfg['embedding_multiplier']}"
    )


def _stop_flag(m: dict) -> str:
    """`--stop-at-step N` when the bundled checkpoint stopped before the end of its schedule."""
    return f" --stop-at-step {m['steps']}" if m["steps"] < m["max_steps"] else ""


def _early_stop_lines(m: dict) -> list[str]:
    if m["steps"] >= m["max_steps"]:
        return []
    return [
        f"- Stopped at step {m['steps']} of {m['max_steps']} (lr then {m['final_lr']:.2e}, the cosine tail) to "
        "deliver the model in time; the schedule is unchanged by stopping, so "
        f"`--stop-at-step {m['steps']}` reproduces this checkpoint.",
    ]


def _calibration_lines(cal: dict | None) -> list[str]:
    if not cal:
        return []
    return [
        f"- Router-bias calibration after training: {cal['steps']} forward passes over the next "
        f"{cal['steps'] * cal['batch_size']} training windows with all weights frozen, the loss-free bias "
        f"step decaying linearly from {cal['gamma']} to 0 (`--calibrate-steps`), so the final biases settle "
        "instead of stopping mid-oscillation.",
    ]


def ablation_section(log_path: Path | None) -> list[str]:
    """Held-out balance of an earlier run with another router, read from its log (if given)."""
    if log_path is None or not log_path.exists():
        return []
    evals = [r for r in read_log(log_path) if r["kind"] == "eval"]
    if not evals:
        return []
    lines = [
        "## Why this router",
        "",
        "An earlier run (same architecture, data and optimiser, but Shazeer's noisy top-k gate with the",
        "LM setting of Shazeer et al. 2017, w_importance = w_load = 0.1, embedding multiplier 1, router lr x 1) was balanced",
        "in training mode (max/mean load about 1.2-1.4 per batch), but only thanks to its noise: the",
        "learned noise std grew above its initial ln 2 while the clean logits stayed small and",
        "alike across tokens, so in eval mode (no noise) most tokens chose the same experts.",
        f"Held-out max/mean load per layer in eval mode (log: `{log_path}`):",
        "",
        "| step | held-out loss | max/mean load per layer |",
        "|---:|---:|---|",
    ]
    for r in evals:
        loads = ", ".join(f"{layer['max_over_mean_load']:.2f}" for layer in r["layers"])
        lines.append(f"| {r['step']} | {r['loss']:.3f} | {loads} |")
    lines += [
        "",
        "Embeddings read the eval-mode routing, so the bundled model balances the selection itself",
        "with the loss-free bias, which acts in eval mode too.",
        "",
    ]
    return lines


def build_card(m: dict, ablation: list[str] | None = None) -> str:
    cfg = m["model_config"]
    lines = [
        "# moee default model (`moee_lm`)",
        "",
        "A small decoder-only sparse Mixture-of-Experts language model trained from scratch on CPU by",
        "`moee train`, bundled so that every moee feature (routing-weight capture, RW/HS/MoEE embeddings,",
        "analyses) runs offline out of the box. It is a toolkit test bed, not a competitive language model.",
        "",
        "Load it with `moee.MoEEmbedder.from_pretrained()` (no name), or directly:",
        "",
        "```python",
        "import moee.moe.lm  # registers model_type 'moee_lm' with the transformers Auto classes",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "model = AutoModelForCausalLM.from_pretrained('moee/assets/default-model')",
        "tokenizer = AutoTokenizer.from_pretrained('moee/assets/default-model')",
        "```",
        "",
        "## Architecture",
        "",
        "| | |",
        "|---|---|",
        f"| layers | {cfg['num_hidden_layers']} pre-norm (RMSNorm) decoder blocks, all MoE (first dense: {cfg['first_k_dense_replace']}) |",
        f"| hidden size | {cfg['hidden_size']} ({cfg['num_attention_heads']} heads, RoPE, causal SDPA) |",
        f"| experts per layer | {cfg['num_experts']} fine-grained {cfg['hidden_act'].upper()} experts, hidden {cfg['moe_intermediate_size']}, shared experts: {cfg['num_shared_experts']} |",
        f"| routing | {_routing_row(cfg)} |",
        f"| balancing | {_balancing_row(cfg, m['optim'])} |",
        f"| vocabulary | {cfg['vocab_size']} (byte-level BPE), LM head tied to the embedding |",
        f"| routing-weight dimensions | {cfg['num_hidden_layers'] - cfg['first_k_dense_replace']} layers x {cfg['num_experts']} experts = {(cfg['num_hidden_layers'] - cfg['first_k_dense_replace']) * cfg['num_experts']} |",
        f"| parameters | {_fmt_int(m['parameters'])} total, about {_fmt_int(m['active_parameters'])} active per token |",
        f"| weights on disk | {m['size_mb']:.1f} MB (`model.safetensors`, {m['dtype']}) |",
        "",
        "## Training",
        "",
        f"- Steps: {m['steps']} of a {m['max_steps']}-step schedule, x {m['batch_size']} windows x {m['seq_len']} tokens = {_fmt_int(m['train_tokens_seen'])} tokens "
        f"({m['epochs_seen']:.2f} epochs of the {_fmt_int(m['train_tokens'])}-token training stream).",
        f"- AdamW (lr {m['optim']['lr']}, betas {m['optim']['betas']}, weight decay {m['optim']['weight_decay']}), "
        f"{m['schedule']['warmup_steps']} warmup steps then cosine to {m['schedule']['min_lr_ratio']} x lr, "
        f"gradient clipping {m['optim']['grad_clip']}, seed {m['seed']}.",
        f"- Throughput: **{m['tokens_per_s']:.0f} tokens/s** (training, mean over the run) on {m['machine']}, "
        f"torch threads = {m['threads']}.",
        f"- Wall clock: {m['train_minutes']:.1f} minutes.",
        *_early_stop_lines(m),
        *_calibration_lines(m.get("bias_calibration")),
        "",
        "![training curve](training_curve.png)",
        "",
        "## Held-out evaluation",
        "",
        f"On the held-out split ({_fmt_int(m['heldout_tokens'])} predicted tokens, {m['heldout_windows']} windows of "
        f"{m['seq_len']} tokens, eval mode so no gate noise):",
        "",
        "| model | cross-entropy (nats/token) | perplexity |",
        "|---|---:|---:|",
        f"| this model | {m['heldout_loss']:.4f} | **{m['heldout_ppl']:.2f}** |",
        f"| add-one unigram of the training tokens | {m['unigram_loss']:.4f} | {m['unigram_ppl']:.2f} |",
        "",
        "Per-layer expert balance on the same held-out tokens (load = number of top-k selections per",
        "expert; CV with the population std; max/mean = heaviest expert's load over the mean load):",
        "",
        "| layer | CV(load) | max/mean load | CV(importance) |",
        "|---:|---:|---:|---:|",
    ]
    for i, layer in enumerate(m["layers"]):
        lines.append(
            f"| {m['moe_layer_indices'][i]} | {layer['cv_load']:.3f} | {layer['max_over_mean_load']:.3f} | {layer['cv_importance']:.3f} |"
        )
    worst = max(layer["max_over_mean_load"] for layer in m["layers"])
    lines += [
        "",
        f"Worst layer max/mean load: **{worst:.3f}** (target <= 1.5).",
        "",
        *(ablation or []),
        "## Data",
        "",
        "Trained on the moee corpus (`scripts/build_corpus.py`): real text from the sources below,",
        "deduplicated, with every evaluation text excluded; the held-out split is hash-selected (~1%).",
        "",
        "| source | description | licence | train chunks |",
        "|---|---|---|---:|",
    ]
    for name, src in m["sources"].items():
        lines.append(
            f"| {name} | {src.get('description', '')} | {src.get('licence', '')} | {_fmt_int(src.get('train_chunks', 0))} |"
        )
    lines += [
        "",
        "## Reproduce",
        "",
        "```bash",
        "python scripts/build_corpus.py && python scripts/build_tokenizer.py   # build/corpus, build/tokenizer",
        f"scripts/train_default_model.sh{_stop_flag(m)}   # moee train --config configs/default_model.json, then this export",
        "```",
        "",
        f"Export command: `{m['command']}`",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()) + ".",
        "",
        "Files: `config.json`, `model.safetensors`, `generation_config.json`, tokenizer files, `metrics.json`",
        "(all figures above), `training_curve.png`.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--run", default="build/train_default", help="training output dir (checkpoints + log.jsonl)"
    )
    p.add_argument("--checkpoint", default=None, help="a specific step_* checkpoint (default: the latest)")
    p.add_argument("--config", default="configs/default_model.json")
    p.add_argument("--out", default="moee/assets/default-model")
    p.add_argument("--heldout-windows", type=int, default=0, help="limit held-out windows (0 = all)")
    p.add_argument("--no-bench-note", action="store_true", help="do not write docs/bench_training.md")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--calibrate-steps",
        type=int,
        default=0,
        help="settle loss-free router biases on training windows (weights frozen) before exporting",
    )
    p.add_argument(
        "--calibrate-gamma", type=float, default=0.002, help="initial bias step of the calibration"
    )
    p.add_argument("--calibrate-batch-size", type=int, default=16)
    p.add_argument(
        "--ablation-log",
        default=None,
        help="log.jsonl of an earlier run with another router, summarised in the card",
    )
    args = p.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    import moee.moe.lm  # noqa: F401  (registers the architecture)
    from moee.moe.checkpoint import latest_checkpoint, read_state
    from moee.moe.lm import MoEEForCausalLM
    from moee.moe.trainer import (
        WindowSampler,
        calibrate_router_biases,
        eval_windows,
        evaluate,
        load_config,
        load_tokens,
        tokenize_to_file,
        unigram_cross_entropy,
    )

    torch.set_num_threads(args.threads)
    run = Path(args.run)
    ckpt = Path(args.checkpoint) if args.checkpoint else latest_checkpoint(run)
    if ckpt is None:
        raise SystemExit(f"no checkpoint found in {run}")
    state = read_state(ckpt)  # verifies every file hash
    cfg = load_config(args.config)
    data = cfg["data"]
    tokenizer = AutoTokenizer.from_pretrained(data["tokenizer"])
    model = MoEEForCausalLM.from_pretrained(ckpt)
    model.eval()

    train_tokens = load_tokens(tokenize_to_file(data["train"], tokenizer, data["cache_dir"]))
    held = eval_windows(
        load_tokens(tokenize_to_file(data["heldout"], tokenizer, data["cache_dir"])),
        data["seq_len"],
        args.heldout_windows or None,
    )
    calibration = None
    if args.calibrate_steps:
        sampler = WindowSampler(train_tokens, data["seq_len"], cfg["seed"])
        start = state["data_position"]
        end = calibrate_router_biases(
            model, sampler, start, args.calibrate_batch_size, args.calibrate_steps, args.calibrate_gamma
        )
        model.eval()
        calibration = {
            "steps": args.calibrate_steps,
            "gamma": args.calibrate_gamma,
            "batch_size": args.calibrate_batch_size,
            "train_windows": [start, end],
        }
    t0 = time.time()
    ev = evaluate(model, held, cfg["eval"]["batch_size"])
    eval_s = time.time() - t0
    uni = unigram_cross_entropy(train_tokens, held, model.config.vocab_size)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.safetensors"):
        stale.unlink()
    # declare the context the model was trained on (RoPE: no position table, so no weight changes)
    model.config.max_position_embeddings = tokenizer.model_max_length = data["seq_len"]
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)

    log = read_log(run / "log.jsonl")
    log = [r for r in log if r["step"] <= state["step"]]
    plot_curve(log, uni, out / "training_curve.png")
    train_recs = [r for r in log if r["kind"] == "train"]
    tok_s = train_recs[-1]["tokens_per_s"] if train_recs else float("nan")
    steps = state["step"]
    bs, seq_len = cfg["optim"]["batch_size"], data["seq_len"]
    n_params = sum(p.numel() for p in model.parameters())
    c = model.config
    per_expert = sum(p[0].numel() for p in model.model.layers[-1].mlp.experts.parameters())
    n_moe = len(c.moe_layer_indices)
    active = n_params - n_moe * c.num_experts * per_expert + n_moe * c.num_experts_per_tok * per_expert
    manifest_path = Path(data["train"]).parent / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {"sources": {}}
    size_mb = sum(f.stat().st_size for f in out.glob("*.safetensors")) / 1e6
    metrics = {
        "checkpoint": str(ckpt),
        "steps": steps,
        "max_steps": state.get("max_steps", cfg["schedule"]["max_steps"]),
        "batch_size": bs,
        "seq_len": seq_len,
        "train_tokens_seen": steps * bs * seq_len,
        "train_tokens": int(len(train_tokens)),
        "epochs_seen": steps * bs / max(1, len(train_tokens) // seq_len),
        "tokens_per_s": tok_s,
        "final_lr": train_recs[-1]["lr"] if train_recs else None,
        "train_minutes": steps * bs * seq_len / tok_s / 60 if tok_s == tok_s and tok_s > 0 else float("nan"),
        "threads": cfg["threads"],
        "machine": f"{platform.machine()} Linux VM with 2 CPU cores shared with other jobs",
        "bias_calibration": calibration,
        "heldout_loss": ev["loss"],
        "heldout_ppl": ev["ppl"],
        "heldout_tokens": ev["tokens"],
        "heldout_windows": int(held.shape[0]),
        "heldout_eval_seconds": eval_s,
        "unigram_loss": uni,
        "unigram_ppl": math.exp(uni),
        "layers": [{k: v for k, v in layer.items()} for layer in ev["layers"]],
        "moe_layer_indices": c.moe_layer_indices,
        "max_over_mean_load_worst": max(layer["max_over_mean_load"] for layer in ev["layers"]),
        "parameters": n_params,
        "active_parameters": active,
        "size_mb": size_mb,
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "model_config": {
            k: getattr(c, k)
            for k in (
                "vocab_size",
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_experts",
                "num_experts_per_tok",
                "moe_intermediate_size",
                "hidden_act",
                "num_shared_experts",
                "first_k_dense_replace",
                "router_type",
                "router_noisy",
                "router_w_importance",
                "router_w_load",
                "router_score_func",
                "router_bias_gamma",
                "embedding_multiplier",
            )
        },
        "optim": cfg["optim"],
        "schedule": cfg["schedule"],
        "seed": cfg["seed"],
        "sources": manifest.get("sources", {}),
        "versions": _versions(),
        "command": "python scripts/export_default_model.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "exported_at": _utc(),
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    ablation = ablation_section(Path(args.ablation_log) if args.ablation_log else None)
    (out / "README.md").write_text(build_card(metrics, ablation))
    if not args.no_bench_note:
        bench = ROOT / "docs" / "bench_training.md"
        bench.parent.mkdir(parents=True, exist_ok=True)
        bench.write_text(
            "## Training throughput (default model)\n\n"
            f"- **{tok_s:.0f} tokens/s** training `MoEEForCausalLM` ({n_params / 1e6:.2f} M parameters, "
            f"{c.num_hidden_layers} MoE layers x {c.num_experts} experts, top-{c.num_experts_per_tok}, "
            f"batch {bs} x {seq_len} tokens, forward + backward + AdamW), mean over {steps} steps.\n"
            f"- Machine: {metrics['machine']} (CPU only), torch {metrics['versions']['torch']}; the "
            "training process ran with CPU priority over the concurrent jobs.\n"
            "- Command: `scripts/train_default_model.sh` (= `moee train --config configs/default_model.json`); "
            "the figure is the `tokens_per_s` of the last record in `build/train_default/log.jsonl`, "
            "copied by `scripts/export_default_model.py` into `moee/assets/default-model/metrics.json`.\n"
            f"- Held-out evaluation (forward only, eval mode): {ev['tokens'] / eval_s:.0f} tokens/s.\n"
        )
    shutil.copy(args.config, out / "training_config.json")
    for f in out.iterdir():
        f.chmod(0o644)  # save_pretrained writes weights as 0600; package data must be world-readable
    print(
        f"exported {ckpt} -> {out}: held-out ppl {ev['ppl']:.2f} (unigram {math.exp(uni):.2f}), "
        f"worst max/mean load {metrics['max_over_mean_load_worst']:.3f}, {size_mb:.1f} MB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
