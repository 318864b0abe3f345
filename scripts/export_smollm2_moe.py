"""Export a training checkpoint of the SmolLM2 MoE as a delta over its dense base, with its figures.

    python scripts/export_smollm2_moe.py --checkpoint build/train_smollm2/step_00000100 \
        --out build/smollm2-moe

Writes into --out: ``delta.safetensors`` (routers and adapters: what training moved), the model's
``config.json``, ``delta.json`` (the digests of the delta, of the base weights it fits and of the
assembled weights, checked by `moee.moe.delta.assemble`), ``moee_embedding.json`` and
``metrics.json``: held-out perplexity of the MoE and of the dense SmolLM2 on the same 256-token
windows, and the load of every layer's router (max/mean of the top-k selections, dead experts) on
whole held-out documents routed as a user's texts are. The assembly is checked here: the model
rebuilt from the base and the delta must give the checkpoint's logits exactly.

Before the delta is written, the loss-free routers' selection biases settle with every weight
frozen (``moee.moe.trainer.calibrate_router_biases``, ``--calibrate-steps``): whole *training*
documents, each routed alone as a user's text is, with the bias step decaying to zero. Training
balances the 256-token windows it sees; this balances what the embedder sees. The held-out
documents measure the result.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

WINDOWS, SEQ_LEN = 64, 256


def perplexity(model, windows: torch.Tensor, batch_size: int = 8) -> float:
    """exp of the mean next-token loss over every predicted position of ``windows``."""
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(windows), batch_size):
            batch = windows[start : start + batch_size]
            out = model(input_ids=batch, labels=batch)
            n = batch.shape[0] * (batch.shape[1] - 1)
            total += float(getattr(out, "lm_loss", None) or out.loss) * n
            count += n
    return math.exp(total / count)


def document_load(model, tokenizer, texts: list[str], max_length: int = SEQ_LEN) -> list[dict]:
    """Per MoE layer: max/mean load and dead experts of the top-k selections over every token of
    ``texts``, each routed alone (no padding), as the embedder routes a user's text."""
    ffns = model.moe_ffns()
    counts = [torch.zeros(ffn.router.num_experts) for ffn in ffns]

    def tally(i: int):
        def hook(_module, _args, out) -> None:  # returns None: the router's output stays as it is
            counts[i].add_(torch.bincount(out[2].reshape(-1), minlength=len(counts[i])).float())

        return hook

    handles = [ffn.router.register_forward_hook(tally(i)) for i, ffn in enumerate(ffns)]
    try:
        with torch.no_grad():
            for text in texts:
                ids = tokenizer(text, truncation=True, max_length=max_length, return_tensors="pt")[
                    "input_ids"
                ]
                model.model.base_model(input_ids=ids)
    finally:
        for h in handles:
            h.remove()
    return [
        {"layer": i, "max_over_mean": round(float(c.max() / c.mean()), 4), "dead": int((c == 0).sum())}
        for i, c in enumerate(counts)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a step_* folder of build/train_smollm2")
    parser.add_argument("--out", required=True, help="the delta folder to write")
    parser.add_argument("--heldout", default="build/corpus/heldout.jsonl")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--dtype",
        choices=("float16", "float32"),
        default="float16",
        help="the delta's stored precision (default %(default)s: half the bytes; every figure is "
        "measured on the model assembled from the stored delta)",
    )
    parser.add_argument(
        "--run",
        default=None,
        help="the training run folder (its log.jsonl is copied as training_log.jsonl and drawn as "
        "training_curve.png; default: the checkpoint's parent folder)",
    )
    parser.add_argument("--train", default="build/corpus/train.jsonl", help="documents to calibrate on")
    parser.add_argument(
        "--calibrate-steps",
        type=int,
        default=64,
        help="bias calibration steps (0: none; default %(default)s)",
    )
    parser.add_argument("--calibrate-documents", type=int, default=8, help="documents per calibration step")
    parser.add_argument("--calibrate-gamma", type=float, default=2e-3, help="first bias step, decaying to 0")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moee.io import iter_jsonl, write_json_atomic
    from moee.models.smollm2 import GGUF_NAME, GGUF_SHA256, PACKAGE, PACKAGE_VERSION, dense_base, file_sha256
    from moee.moe.delta import MANIFEST_FILE, assemble, build_from_delta, save_delta
    from moee.moe.trainer import (
        DocumentSampler,
        calibrate_router_biases,
        eval_windows,
        load_tokens,
        tokenize_to_file,
    )
    from moee.moe.upcycled import MoEEUpcycledForCausalLM
    from moee.provenance import package_versions

    base = dense_base()
    model = MoEEUpcycledForCausalLM.from_pretrained(args.checkpoint).eval()
    tokenizer = AutoTokenizer.from_pretrained(base)
    calibration = None
    if args.calibrate_steps:
        documents = DocumentSampler.from_jsonl(
            args.train, tokenizer, SEQ_LEN, seed=0, limit=args.calibrate_steps * args.calibrate_documents
        )
        calibrate_router_biases(
            model,
            None,
            0,
            0,
            args.calibrate_steps,
            args.calibrate_gamma,
            documents=documents,
            documents_per_step=args.calibrate_documents,
        )
        model.eval()
        calibration = {
            "steps": args.calibrate_steps,
            "documents_per_step": args.calibrate_documents,
            "gamma": args.calibrate_gamma,
            "source": args.train,
        }
    out = save_delta(
        model,
        args.out,
        {
            "source": f"{PACKAGE}=={PACKAGE_VERSION}/{GGUF_NAME}",
            "gguf_sha256": GGUF_SHA256,
            "weights_sha256": file_sha256(base / "model.safetensors"),
        },
        dtype=getattr(torch, args.dtype),
    )
    # the model's own embedding configuration (what every command uses when no flag says otherwise)
    write_json_atomic(
        out / "moee_embedding.json",
        {
            "format": "moee-embedding-config",
            "format_version": 1,
            "config": {
                "method": "moee_sum",
                "pooling": "mean",
                "prompt": None,
                "score": "native",
                "alpha": 1.0,
            },
        },
    )
    texts = [row["text"] for _, row in iter_jsonl(args.heldout)]
    windows = eval_windows(
        load_tokens(tokenize_to_file(args.heldout, tokenizer, "build/tokens")), SEQ_LEN, WINDOWS
    )
    with tempfile.TemporaryDirectory() as tmp:  # the folder built from the delta = the model in memory
        built = MoEEUpcycledForCausalLM.from_pretrained(assemble(out, base, Path(tmp) / "m")).eval()
        model = build_from_delta(out, base)  # the stored (rounded) delta: what every figure measures
        probe = windows[:2]
        with torch.no_grad():
            if not torch.equal(built(input_ids=probe).logits, model(input_ids=probe).logits):
                raise SystemExit("the model assembled from the delta does not reproduce the delta's model")
        manifest = json.loads((out / MANIFEST_FILE).read_text())
        manifest["model_sha256"] = file_sha256(Path(tmp) / "m" / "model.safetensors")
        write_json_atomic(out / MANIFEST_FILE, manifest)
    dense = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    ppl_moe, ppl_dense = perplexity(model, windows), perplexity(dense, windows)
    load = document_load(model, tokenizer, texts)
    metrics = {
        "checkpoint": Path(args.checkpoint).name,
        "heldout_windows": {"count": len(windows), "seq_len": SEQ_LEN, "source": args.heldout},
        "perplexity": {
            "moe": round(ppl_moe, 3),
            "dense": round(ppl_dense, 3),
            "ratio": round(ppl_moe / ppl_dense, 4),
        },
        "document_load": {
            "documents": len(texts),
            "worst_max_over_mean": max(r["max_over_mean"] for r in load),
            "dead": sum(r["dead"] for r in load),
            "layers": load,
        },
        "bias_calibration": calibration,
        "delta_bytes": (out / "delta.safetensors").stat().st_size,
        "versions": package_versions(("moee", "torch", "transformers", "tokenizers"), omit_missing=()),
        "command": "python scripts/export_smollm2_moe.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    run = Path(args.run) if args.run else Path(args.checkpoint).parent
    if (run / "log.jsonl").is_file():  # the run's log up to this checkpoint, and its curve
        from export_default_model import plot_curve

        step = int(Path(args.checkpoint).name.rsplit("_", 1)[-1])
        log = [row for _, row in iter_jsonl(run / "log.jsonl") if row.get("step", 0) <= step]
        with open(out / "training_log.jsonl", "w") as fh:
            fh.writelines(json.dumps(row) + "\n" for row in log)
        plot_curve(
            log,
            math.log(ppl_dense),
            out / "training_curve.png",
            baseline_label=f"dense SmolLM2 on the export's {WINDOWS} held-out windows",
            title="SmolLM2 MoE: routers and adapters trained",
            marks=((math.log(ppl_moe), f"this checkpoint on the same {WINDOWS} windows"),),
        )
        metrics["training_log"] = {"run": str(run), "rows": len(log)}
    write_json_atomic(out / "metrics.json", metrics)
    print(
        json.dumps({k: metrics[k] for k in ("perplexity", "delta_bytes")}),
        metrics["document_load"]["worst_max_over_mean"],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
