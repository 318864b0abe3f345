"""Benchmark 3 (BENCHMARKS.md): embedding pipeline throughput on a realistic length mix.

Three pipelines embed the same texts with the same model and batch size, timed interleaved:

* ``ours``: ``MoEEmbedder.encode`` (length-sorted batches, left padding, router capture pooled
  inside hooks, backbone only).
* ``naive``: what one writes without moee: batches in input order, right padding, one forward of
  the backbone with ``output_router_logits=True, output_hidden_states=True``, then pooling of the
  returned tensors afterwards (last real token; softmax of its router logits) and the same
  ``combine``. It runs the backbone, not the LM head, so the ratio measures batching and capture
  only (a user calling ``AutoModelForCausalLM`` would also pay for the vocabulary projection;
  ``--naive-lm-head`` times that variant too).
* ``sentence_transformers``: ``models.Transformer`` + ``models.Pooling(pooling_mode="lasttoken")``
  on the same checkpoint, compared with ``encode(method="hs")`` (the same HS vector).

Before timing, the vectors are checked equal (naive vs ours, MoEE sum; sentence-transformers vs
ours, HS up to normalisation).

Goals: ours >= 2x naive; ours (HS) >= 1x sentence-transformers.

    nice -n 10 env OMP_NUM_THREADS=1 python scripts/bench_pipeline.py [--model tiny|default|PATH]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch

from moee.benchmarking import (
    benchmark_tokenizer,
    length_mix_texts,
    paired_ratio,
    summarize,
    time_interleaved,
    write_result,
)
from moee.embed.methods import combine


def build_tiny(out_dir: Path, tokenizer, seed: int = 0) -> Path:
    """Save the benchmarks' tiny OLMoE (hidden 256, 4 layers, 16 experts, top-2) with ``tokenizer``."""
    from transformers import AutoModelForCausalLM

    from moee.capture.tiny import tiny_config

    config = tiny_config(
        "olmoe",
        hidden_size=256,
        n_layers=4,
        n_experts=16,
        top_k=2,
        vocab_size=len(tokenizer),
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.cls_token_id if tokenizer.bos_token_id is None else tokenizer.bos_token_id,
        eos_token_id=tokenizer.sep_token_id if tokenizer.eos_token_id is None else tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


class NaivePipeline:
    """Input order, fixed batches, full router/hidden-state outputs, pooling afterwards."""

    def __init__(self, model, tokenizer, max_length: int, use_lm_head: bool = False) -> None:
        self.model = model if use_lm_head else model.base_model
        self.full_model = model  # routers are declared on the full model (_can_record_outputs)
        self.tokenizer = tokenizer
        self.max_length = max_length

    def _forward(self, enc):
        """The model's own ``output_router_logits`` where it has one (OLMoE-style), else what a user
        would write: a forward hook on each router keeping its full logits."""
        try:
            out = self.model(**enc, output_router_logits=True, output_hidden_states=True, use_cache=False)
            logits = getattr(out, "router_logits", None)
        except TypeError:
            out, logits = None, None
        if logits:
            return out, logits
        from moee.capture.registry import find_routers

        kept: list[torch.Tensor] = []
        handles = [
            spec.module.register_forward_hook(
                lambda _m, _i, o: kept.append(o[0] if isinstance(o, tuple) else o)
            )
            for spec in find_routers(self.full_model)
        ]
        try:
            out = self.model(**enc, output_hidden_states=True, use_cache=False)
        finally:
            for h in handles:
                h.remove()
        return out, kept

    def encode(self, texts: list[str], batch_size: int, alpha: float = 1.0) -> np.ndarray:
        hs_rows, rw_rows = [], []
        self.tokenizer.padding_side = "right"
        with torch.inference_mode():
            for start in range(0, len(texts), batch_size):
                enc = self.tokenizer(
                    texts[start : start + batch_size],
                    padding=True,
                    truncation=True,
                    max_length=self.max_length,
                    return_tensors="pt",
                )
                out, router_logits = self._forward(enc)
                last = enc["attention_mask"].sum(1) - 1
                rows = torch.arange(len(last))
                hs_rows.append(out.hidden_states[-1][rows, last].float())
                batch, width = enc["input_ids"].shape
                layers = [
                    lg.reshape(batch, width, -1)[rows, last].float().softmax(-1) for lg in router_logits
                ]
                rw_rows.append(torch.stack(layers, dim=1))
        return combine(torch.cat(hs_rows).numpy(), torch.cat(rw_rows).numpy(), "moee_sum", alpha=alpha)


def sentence_transformer(path: Path, max_length: int):
    """Transformer + last-token Pooling, the way sentence-transformers serves decoder embedders."""
    from sentence_transformers import SentenceTransformer

    try:  # sentence-transformers >= 6
        from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    except ImportError:
        from sentence_transformers.models import Pooling, Transformer

    transformer = Transformer(str(path), max_seq_length=max_length)
    dim = getattr(transformer, "get_embedding_dimension", None) or transformer.get_word_embedding_dimension
    return SentenceTransformer(modules=[transformer, Pooling(dim(), pooling_mode="lasttoken")], device="cpu")


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="tiny", help="tiny (the benchmarks' tiny OLMoE), default (bundled) or a path"
    )
    parser.add_argument("--texts", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--naive-lm-head", action="store_true", help="also time the naive pipeline with the LM head"
    )
    parser.add_argument("--name", default=None, help="result name (default pipeline or pipeline_<model>)")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args(argv)

    from moee import MoEEmbedder

    texts = length_mix_texts(args.texts, seed=0)
    tmp = tempfile.TemporaryDirectory()
    if args.model == "tiny":
        path = build_tiny(Path(tmp.name), benchmark_tokenizer())
    elif args.model == "default":
        from moee.embed.embedder import MINILM_MOE_DIR

        path = MINILM_MOE_DIR
    else:
        path = Path(args.model)
    ours = MoEEmbedder.from_pretrained(path, device="cpu", dtype=torch.float32)
    max_length = ours.max_length
    tok = ours.tokenizer
    full_lengths = np.array([len(ids) for ids in tok(texts, add_special_tokens=True)["input_ids"]])
    lengths = np.minimum(full_lengths, max_length)
    # Texts longer than the model are truncated by each pipeline its own way (ours cuts the token
    # ids, the tokenizer's truncation keeps special tokens), so equality is checked on the rest.
    fits = full_lengths <= max_length
    bs = args.batch_size
    in_order = [lengths[i : i + bs].max() * len(lengths[i : i + bs]) for i in range(0, len(lengths), bs)]
    by_length = np.sort(lengths)[::-1]
    sorted_batches = [
        by_length[i : i + bs].max() * len(by_length[i : i + bs]) for i in range(0, len(lengths), bs)
    ]
    naive = NaivePipeline(ours.model, _fresh_tokenizer(path), max_length)

    variants = {
        # score="softmax": the naive recipe takes the softmax of output_router_logits, so both sides
        # compute the same vectors for every router (the default, the router's own rule, differs for
        # sigmoid routers such as the bundled one's)
        "ours_moee_sum": lambda: ours.encode(
            texts, score="softmax", pooling="last", batch_size=bs, show_progress_bar=False
        ),
        "naive_moee_sum": lambda: naive.encode(texts, bs),
        "ours_hs": lambda: ours.encode(
            texts, method="hs", pooling="last", batch_size=bs, show_progress_bar=False
        ),
    }
    st_error = None
    try:
        st = sentence_transformer(path, max_length)
        variants["sentence_transformers_hs"] = lambda: st.encode(
            texts, batch_size=bs, convert_to_numpy=True, show_progress_bar=False
        )
    except Exception as exc:  # e.g. an architecture AutoModel cannot load; reported, not hidden
        st_error = f"{type(exc).__name__}: {exc}"
    if args.naive_lm_head:
        naive_lm = NaivePipeline(ours.model, _fresh_tokenizer(path), max_length, use_lm_head=True)
        variants["naive_lm_head_moee_sum"] = lambda: naive_lm.encode(texts, bs)

    # Same vectors first (otherwise a faster pipeline could simply be computing something else).
    checks = {}
    ref = variants["ours_moee_sum"]()
    checks["naive_vs_ours_moee_sum_max_abs"] = float(np.abs(variants["naive_moee_sum"]() - ref)[fits].max())
    if "sentence_transformers_hs" in variants:
        hs = variants["ours_hs"]()
        st_hs = _unit(variants["sentence_transformers_hs"]())
        checks["st_vs_ours_hs_max_abs"] = float(np.abs(st_hs - hs)[fits].max())
    for key, value in checks.items():
        if not value < 1e-3:
            raise SystemExit(
                f"pipelines disagree ({key} = {value:.3g}); refusing to time different computations"
            )

    times = time_interleaved(variants, repeats=args.repeats, warmup=1)
    n = len(texts)
    result = {
        "goal": {"ours_vs_naive": ">= 2x", "ours_vs_sentence_transformers": ">= 1x"},
        "config": {
            "model": str(args.model),
            "model_class": type(ours.model).__name__,
            "moe_layers": ours.n_moe_layers,
            "experts": ours.n_experts,
            "hidden": ours.hidden_size,
            "tokenizer": type(tok).__name__,
            "texts": n,
            "text_source": "moee/data/offline/*/*.jsonl (random order)",
            "tokens_per_text": {
                "mean": float(lengths.mean()),
                "p5": float(np.percentile(lengths, 5)),
                "p50": float(np.percentile(lengths, 50)),
                "p95": float(np.percentile(lengths, 95)),
                "max": int(lengths.max()),
            },
            "truncated_texts_excluded_from_equality_check": int((~fits).sum()),
            "batch_size": bs,
            # token positions each pipeline pushes through the model (real + padding)
            "padded_tokens": {
                "real": int(lengths.sum()),
                "input_order_batches": int(sum(in_order)),
                "length_sorted_batches": int(sum(sorted_batches)),
            },
            "repeats": args.repeats,
            "dtype": "float32",
        },
        "equality_checks": checks,
        "sentence_transformers_error": st_error,
        "throughput": {name: summarize(ts, n, "texts") for name, ts in times.items()},
        "speedups": {
            "ours_vs_naive": paired_ratio(times["naive_moee_sum"], times["ours_moee_sum"]),
        },
    }
    if "sentence_transformers_hs" in times:
        result["speedups"]["ours_hs_vs_sentence_transformers"] = paired_ratio(
            times["sentence_transformers_hs"], times["ours_hs"]
        )
    if "naive_lm_head_moee_sum" in times:
        result["speedups"]["ours_vs_naive_lm_head"] = paired_ratio(
            times["naive_lm_head_moee_sum"], times["ours_moee_sum"]
        )
    result["passed"] = {
        "vs_naive": result["speedups"]["ours_vs_naive"] >= 2.0,
        "vs_sentence_transformers": result["speedups"].get("ours_hs_vs_sentence_transformers", 0.0) >= 1.0,
    }
    name = args.name or ("pipeline" if args.model == "tiny" else f"pipeline_{Path(str(args.model)).name}")
    out = write_result(name, result, args.out_dir)
    print(f"wrote {out}")
    for key, stats in result["throughput"].items():
        print(f"  {key:>26}: {stats['texts_per_s']:8.1f} texts/s")
    for key, value in result["speedups"].items():
        print(f"  {key}: {value:.2f}x")
    tmp.cleanup()
    return 0


def _fresh_tokenizer(path: Path):
    """A separate tokenizer object (the embedder sets left padding on its own)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


if __name__ == "__main__":
    raise SystemExit(main())
