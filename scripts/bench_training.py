"""Benchmark 5 (BENCHMARKS.md): training throughput and model FLOP utilisation of the default model.

Builds ``MoEEForCausalLM`` from the training config (``configs/default_model.json``: model,
sequence length, batch size, AdamW settings) and times full training steps (forward with labels,
backward, gradient clipping, AdamW step) interleaved with a dense-matmul probe: the same GEMM
shapes the model runs (attention projections, the experts at their average tokens per expert,
the LM head; forward and both backward products), with plain ``torch.matmul``. The figure is

    achieved FLOP/s = (6 * active params per token + 12 * layers * d_model * seq_len) * tokens / step time
    MFU = achieved FLOP/s / probe FLOP/s                                          [goal >= 40%]

"active params" counts every weight a token multiplies by: attention, routers, the k of E routed
experts (k/E of the expert weights), shared/dense FFNs and the LM head (tied with the embedding,
counted once; the embedding lookup itself is not a matmul). The attention term is PaLM's
(QK^T and AV, forward and backward). The probe also runs one large (2048^3) square matmul, this machine's
best-case dense FLOP/s, reported beside it.

Batches are windows of the training corpus when its token cache exists (``data.cache_dir``),
else uniformly random token ids (routing is then less skewed than on text; noted in the JSON).

    nice -n 10 env OMP_NUM_THREADS=1 python scripts/bench_training.py [--config configs/default_model.json]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import numpy as np
import torch

from moee.benchmarking import summarize, time_interleaved, write_result

ROOT = Path(__file__).resolve().parent.parent


def active_params(model: torch.nn.Module) -> dict[str, float]:
    """Weights one token multiplies by, split by kind (routed experts scaled by k/E)."""
    from moee.moe.layer import MoELayer

    routed_total = 0.0
    routed_active = 0.0
    routed_ids = set()
    for module in model.modules():
        if isinstance(module, MoELayer):
            n = sum(p.numel() for p in module.experts.parameters())
            routed_total += n
            routed_active += n * module.k / module.n_experts
            routed_ids.update(id(p) for p in module.experts.parameters())
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    other = sum(
        p.numel() for p in model.parameters() if id(p) not in routed_ids and p is not embed and p is not head
    )
    lm_head = head.numel()
    return {
        "total": float(sum(p.numel() for p in model.parameters())),
        "routed_experts_total": routed_total,
        "routed_experts_active": routed_active,
        "attention_router_dense_norm": float(other),
        "lm_head": float(lm_head),
        "active_per_token": routed_active + other + lm_head,
    }


def gemm_shapes(model: torch.nn.Module, tokens: int) -> list[tuple[int, int, int, int]]:
    """``(count, M, K, N)`` of the forward GEMMs of one step (attention, experts, LM head)."""
    from moee.moe.layer import MoELayer

    cfg = model.config
    d = cfg.hidden_size
    shapes: list[tuple[int, int, int, int]] = []
    n_layers = cfg.num_hidden_layers
    shapes.append((4 * n_layers, tokens, d, d))  # q, k, v, o
    for module in model.modules():
        if isinstance(module, MoELayer):
            e, k = module.n_experts, module.k
            per_expert = max(1, round(tokens * k / e))
            w_in, w_out = module.experts.w_in, module.experts.w_out
            shapes.append((e, per_expert, w_in.shape[1], w_in.shape[2]))
            shapes.append((e, per_expert, w_out.shape[1], w_out.shape[2]))
            if module.shared_experts is not None:
                ffn = module.shared_experts.ffn
                shapes.append((1, tokens, ffn.w_in.shape[1], ffn.w_in.shape[2]))
                shapes.append((1, tokens, ffn.w_out.shape[1], ffn.w_out.shape[2]))
    for layer in range(getattr(cfg, "first_k_dense_replace", 0)):
        ffn = model.model.layers[layer].mlp.ffn
        shapes.append((1, tokens, ffn.w_in.shape[1], ffn.w_in.shape[2]))
        shapes.append((1, tokens, ffn.w_out.shape[1], ffn.w_out.shape[2]))
    shapes.append((1, tokens, d, cfg.vocab_size))
    return shapes


class MatmulProbe:
    """Dense matmuls of the model's GEMM shapes: forward ``A@B``, backward ``G@B^T`` and ``A^T@G``."""

    def __init__(self, shapes: list[tuple[int, int, int, int]], seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.work = []
        self.flops = 0.0
        for count, m, k, n in shapes:
            a, b, g = (torch.randn(s, generator=gen) for s in ((m, k), (k, n), (m, n)))
            self.work.append((count, a, b, g))
            self.flops += count * 3 * 2 * m * k * n

    def __call__(self) -> None:
        for count, a, b, g in self.work:
            for _ in range(count):
                a @ b
                g @ b.T
                a.T @ g


def load_batches(
    cfg: dict, vocab_size: int, batch_size: int, seq_len: int, n: int, seed: int
) -> tuple[list, str]:
    """``n`` training batches of real corpus windows if the token cache exists, else random ids."""
    from moee.moe.trainer import WindowSampler, load_tokens, tokenize_to_file

    data = cfg["data"]
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(ROOT / data["tokenizer"])
        tokens = load_tokens(tokenize_to_file(ROOT / data["train"], tokenizer, ROOT / data["cache_dir"]))
        sampler = WindowSampler(tokens, seq_len, seed)
        return [sampler.batch(i * batch_size, batch_size) for i in range(n)], "corpus windows"
    except (OSError, TypeError, ValueError) as exc:
        gen = torch.Generator().manual_seed(seed)
        batches = [torch.randint(0, vocab_size, (batch_size, seq_len), generator=gen) for _ in range(n)]
        return batches, f"random token ids ({type(exc).__name__}: {exc})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "default_model.json"))
    parser.add_argument(
        "--steps", type=int, default=6, help="timed training steps (each paired with a probe)"
    )
    parser.add_argument("--batch-size", type=int, default=None, help="override optim.batch_size")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: OMP_NUM_THREADS or 1)"
    )
    parser.add_argument("--profile", action="store_true", help="add a torch.profiler table of one step")
    parser.add_argument("--name", default="training")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args(argv)

    import os

    from moee.moe.lm import MoEEConfig, MoEEForCausalLM
    from moee.moe.trainer import load_config

    torch.set_num_threads(args.threads or int(os.environ.get("OMP_NUM_THREADS", "1")))
    cfg = load_config(args.config)
    seq_len = cfg["data"]["seq_len"]
    batch_size = args.batch_size or cfg["optim"]["batch_size"]
    model_kwargs = dict(cfg["model"])
    vocab_source = "config"
    if "vocab_size" not in model_kwargs:
        try:
            from transformers import AutoTokenizer

            model_kwargs["vocab_size"] = len(AutoTokenizer.from_pretrained(ROOT / cfg["data"]["tokenizer"]))
            vocab_source = "tokenizer"
        except (OSError, TypeError, ValueError):
            vocab_source = "MoEEConfig default (tokenizer not built)"
    model_kwargs.setdefault("max_position_embeddings", seq_len)
    torch.manual_seed(cfg["seed"])
    model = MoEEForCausalLM(MoEEConfig(**model_kwargs)).train()
    vocab = model.config.vocab_size
    opt = cfg["optim"]
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=opt["lr"],
        betas=tuple(opt["betas"]),
        eps=opt["eps"],
        weight_decay=opt["weight_decay"],
    )
    batches, data_source = load_batches(cfg, vocab, batch_size, seq_len, args.steps + 2, cfg["seed"])
    position = iter(range(10**9))

    def train_step() -> None:
        batch = batches[next(position) % len(batches)]
        out = model(input_ids=batch, labels=batch)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), opt["grad_clip"])
        optimizer.step()

    tokens = batch_size * seq_len
    params = active_params(model)
    cfg_m = model.config
    flops_per_token = (
        6 * params["active_per_token"] + 12 * cfg_m.num_hidden_layers * cfg_m.hidden_size * seq_len
    )
    probe = MatmulProbe(gemm_shapes(model, tokens))
    n_sq = 2048  # large enough to reach the BLAS peak, long enough (~0.3 s) to time well
    square = torch.randn(n_sq, n_sq), torch.randn(n_sq, n_sq)

    times = time_interleaved(
        {"train_step": train_step, "matmul_probe": probe, "square_matmul": lambda: square[0] @ square[1]},
        repeats=args.steps,
        warmup=1,
    )
    step_s = summarize(times["train_step"], tokens, "tokens")
    achieved = [flops_per_token * tokens / t for t in times["train_step"]]
    probe_rate = [probe.flops / t for t in times["matmul_probe"]]
    square_rate = [2 * n_sq**3 / t for t in times["square_matmul"]]
    result = {
        "goal": {"mfu_vs_matmul_of_same_shapes": ">= 0.40"},
        "config": {
            "config_file": str(Path(args.config).resolve().relative_to(ROOT))
            if Path(args.config).resolve().is_relative_to(ROOT)
            else args.config,
            "model": {
                k: getattr(cfg_m, k)
                for k in (
                    "vocab_size",
                    "hidden_size",
                    "num_hidden_layers",
                    "num_attention_heads",
                    "num_experts",
                    "num_experts_per_tok",
                    "moe_intermediate_size",
                    "num_shared_experts",
                    "first_k_dense_replace",
                    "router_type",
                    "hidden_act",
                )
            },
            "vocab_source": vocab_source,
            "seq_len": seq_len,
            "batch_size": batch_size,
            "tokens_per_step": tokens,
            "torch_threads": torch.get_num_threads(),
            "data": data_source,
            "steps": args.steps,
        },
        "params": params,
        "flops_per_token": flops_per_token,
        "train_step": step_s,
        "achieved_flops_per_s": float(np.median(achieved)),
        "matmul_probe_flops_per_s": float(np.median(probe_rate)),
        "square_matmul_size": n_sq,
        "square_matmul_flops_per_s": float(np.median(square_rate)),
        # per-step pairs: a step and the probe next to it see the same machine load
        "mfu_vs_matmul_of_same_shapes": statistics.median(a / p for a, p in zip(achieved, probe_rate)),
        "mfu_vs_square_matmul": float(np.median(achieved) / np.median(square_rate)),
    }
    result["passed"] = {"mfu": result["mfu_vs_matmul_of_same_shapes"] >= 0.40}
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            train_step()
        result["profile"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    path = write_result(args.name, result, args.out_dir)
    print(f"wrote {path}")
    print(
        f"  {step_s['tokens_per_s']:.0f} tokens/s; {result['achieved_flops_per_s'] / 1e9:.2f} GFLOP/s achieved"
    )
    print(
        f"  matmul probe {result['matmul_probe_flops_per_s'] / 1e9:.2f} GFLOP/s; square {result['square_matmul_flops_per_s'] / 1e9:.2f}"
    )
    print(
        f"  MFU (same shapes) {result['mfu_vs_matmul_of_same_shapes']:.1%}; vs square {result['mfu_vs_square_matmul']:.1%}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
