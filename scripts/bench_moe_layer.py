"""Benchmark 4 (BENCHMARKS.md): forward+backward tokens/s of our MoE layer vs transformers and the reference loop.

Same configuration everywhere: E=64 experts, top-k=8, d=256, SwiGLU experts of hidden width 128,
4,096 tokens, float32, router softmax over the k selected logits (Shazeer's
``Softmax(KeepTopK(x W_g, k))``, which is OLMoE with ``norm_topk_prob=True``). Weights are copied
from the transformers block into the other two, and the outputs and input gradients are checked
equal before anything is timed.

Variants, timed interleaved in one process:
* ``ours``: ``moee.moe.layer.MoELayer``.
* ``hf_<impl>``: ``transformers``' ``OlmoeSparseMoeBlock`` with each CPU-usable experts
  implementation (``grouped_mm`` is what ``from_pretrained`` picks by default, ``eager`` is the
  per-expert loop). ``batched_mm`` gathers one weight matrix per (token, expert) pair (8 GB here)
  and is meant for decoding, so it is left out unless asked for.
* ``seeds_loop``: the textbook per-expert reference layer: for each expert
  ``mask = (topk_idx == i).any(-1); out[mask] += gate[mask, i:i+1] * f_i(x[mask])``.

Goal: ours >= 1x the transformers block, >= 5x the reference loop.

    nice -n 10 env OMP_NUM_THREADS=1 python scripts/bench_moe_layer.py [--profile]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from moee.benchmarking import paired_ratio, summarize, time_interleaved, write_result


class SwiGLUExpert(nn.Module):
    """One expert as its own module, as in the textbook layer (``experts`` is a list of networks ``f_i``)."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        self.gate_up = nn.Linear(gate_up.shape[1], gate_up.shape[0], bias=False)
        self.down = nn.Linear(down.shape[1], down.shape[0], bias=False)
        with torch.no_grad():
            self.gate_up.weight.copy_(gate_up)
            self.down.weight.copy_(down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(g) * u)


class SeedsLoopMoE(nn.Module):
    """The textbook per-expert ``moe_layer(x, experts, gate, topk_idx)`` loop with a top-k softmax gate.

    Weights are taken from the transformers block (router ``[E, d]``, ``gate_up [E, 2h, d]``,
    ``down [E, d, h]``) and split into one module per expert.
    """

    def __init__(
        self, router_weight: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, k: int
    ) -> None:
        super().__init__()
        self.router = nn.Linear(router_weight.shape[1], router_weight.shape[0], bias=False)
        with torch.no_grad():
            self.router.weight.copy_(router_weight)
        self.experts = nn.ModuleList(SwiGLUExpert(gate_up[i], down[i]) for i in range(router_weight.shape[0]))
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)
        top_val, topk_idx = logits.topk(self.k, dim=-1)
        masked = torch.full_like(logits, float("-inf")).scatter(-1, topk_idx, top_val)
        gate = masked.softmax(-1)  # dense [N, E], exactly E - k zeros per row
        out = torch.zeros_like(x)
        for i, f in enumerate(self.experts):
            mask = (topk_idx == i).any(-1)
            if mask.any():
                out[mask] += gate[mask, i : i + 1] * f(x[mask])
        return out


class MatmulFloor:
    """The layer's GEMMs alone, as three batched matmuls per weight (forward, input and weight grads).

    Router ``[N, d] x [d, E]``, then per expert (perfectly balanced, ``N*k/E`` rows each) the SwiGLU
    in-projection ``[n_e, d] x [d, 2h]`` and out-projection ``[n_e, h] x [h, d]``. Every MoE
    implementation must do at least this arithmetic, so ``seeds_loop time / floor time`` bounds
    the speedup any implementation can reach over the reference loop on this machine.
    """

    def __init__(self, tokens: int, d: int, hidden: int, experts: int, k: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        per = max(1, tokens * k // experts)
        self.shapes = [((tokens, d), (d, experts))] + [((experts, per, d), (experts, d, 2 * hidden))]
        self.shapes.append(((experts, per, hidden), (experts, hidden, d)))
        self.tensors = [
            (
                torch.randn(a, generator=gen),
                torch.randn(b, generator=gen),
                torch.randn((*a[:-1], b[-1]), generator=gen),
            )
            for a, b in self.shapes
        ]

    def __call__(self) -> None:
        for a, b, g in self.tensors:
            a @ b
            g @ b.transpose(-1, -2)
            a.transpose(-1, -2) @ g


def make_hf_block(args: argparse.Namespace, impl: str) -> nn.Module:
    from transformers import OlmoeConfig
    from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock

    cfg = OlmoeConfig(
        hidden_size=args.d,
        intermediate_size=args.hidden,
        num_experts=args.experts,
        num_experts_per_tok=args.k,
        norm_topk_prob=True,
        experts_implementation=impl,
    )
    torch.manual_seed(args.seed)
    block = OlmoeSparseMoeBlock(cfg)
    nn.init.normal_(block.gate.weight, std=0.5 / args.d**0.5)
    nn.init.normal_(block.experts.gate_up_proj, std=1.0 / args.d**0.5)
    nn.init.normal_(block.experts.down_proj, std=1.0 / args.hidden**0.5)
    return block


def make_ours(args: argparse.Namespace, ref: nn.Module) -> nn.Module:
    """Our MoELayer (deterministic top-k gate, SwiGLU experts) with the reference block's weights."""
    from moee.moe.gates import NoisyTopKGate
    from moee.moe.layer import MoELayer

    gate = NoisyTopKGate(args.d, args.experts, args.k, noisy=False)
    layer = MoELayer(args.d, args.hidden, args.experts, args.k, activation="swiglu", gate=gate)
    with torch.no_grad():
        layer.gate.gate.w_gate.weight.copy_(ref.gate.weight)  # [E, d]
        # transformers stores [E, 2h, d] (gate rows, then up rows) and [E, d, h]; ours is x @ W.
        layer.experts.w_in.copy_(ref.experts.gate_up_proj.transpose(1, 2))
        layer.experts.w_out.copy_(ref.experts.down_proj.transpose(1, 2))
    return layer


class _Flat(nn.Module):
    """Adapts ``[N, d] -> [N, d]`` to modules that want ``[1, N, d]`` (the transformers block)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.unsqueeze(0)).squeeze(0)


def _output(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = module(x)
    return out[0] if isinstance(out, tuple) else out


def fwd_bwd(module: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """One training step's worth of layer work: forward, then backward to weights and input."""
    x = x.detach().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    _output(module, x).backward(grad)
    return x.grad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-impls", nargs="+", default=["grouped_mm", "eager"])
    parser.add_argument(
        "--profile", action="store_true", help="also write a torch.profiler table per variant"
    )
    parser.add_argument("--name", default="moe_layer")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args(argv)

    hf = {impl: _Flat(make_hf_block(args, impl)) for impl in args.hf_impls}
    ref = next(iter(hf.values())).inner
    for block in hf.values():  # identical weights in every transformers variant
        block.inner.load_state_dict(ref.state_dict())
    variants: dict[str, nn.Module] = {"ours": make_ours(args, ref)}
    variants.update({f"hf_{impl}": block for impl, block in hf.items()})
    variants["seeds_loop"] = SeedsLoopMoE(
        ref.gate.weight, ref.experts.gate_up_proj, ref.experts.down_proj, args.k
    )

    gen = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(args.tokens, args.d, generator=gen)
    grad = torch.randn(args.tokens, args.d, generator=gen)

    # Correctness first: every variant computes the same function (outputs and input gradients).
    base_name = f"hf_{args.hf_impls[0]}"
    with torch.no_grad():
        base_out = _output(variants[base_name], x)
    base_grad = fwd_bwd(variants[base_name], x, grad)
    checks = {}
    for name, module in variants.items():
        with torch.no_grad():
            out = _output(module, x)
        g = fwd_bwd(module, x, grad)
        checks[name] = {
            "max_abs_diff_output": float((out - base_out).abs().max()),
            "max_abs_diff_input_grad": float((g - base_grad).abs().max()),
        }
        if not (
            torch.allclose(out, base_out, atol=1e-4, rtol=1e-4)
            and torch.allclose(g, base_grad, atol=1e-4, rtol=1e-4)
        ):
            raise SystemExit(f"{name} does not compute the same function as {base_name}: {checks[name]}")

    timed = {name: (lambda m=module: fwd_bwd(m, x, grad)) for name, module in variants.items()}
    timed["matmul_floor"] = MatmulFloor(args.tokens, args.d, args.hidden, args.experts, args.k, args.seed)
    times = time_interleaved(timed, repeats=args.repeats, warmup=2)
    result = {
        "goal": {"ours_vs_transformers": ">= 1x", "ours_vs_seeds_loop": ">= 5x"},
        "config": {
            "experts": args.experts,
            "k": args.k,
            "d": args.d,
            "expert_hidden": args.hidden,
            "tokens": args.tokens,
            "dtype": "float32",
            "repeats": args.repeats,
            "expert": "SwiGLU",
        },
        "equality_checks_vs_" + base_name: checks,
        "forward_backward": {name: summarize(ts, args.tokens, "tokens") for name, ts in times.items()},
        "speedup_of_ours": {
            name: paired_ratio(times[name], times["ours"])
            for name in times
            if name not in ("ours", "matmul_floor")
        },
        # how close each variant is to pure GEMM time, and the best any variant could do vs the loop
        "time_over_matmul_floor": {
            name: paired_ratio(times[name], times["matmul_floor"]) for name in times if name != "matmul_floor"
        },
    }
    result["max_possible_speedup_vs_seeds_loop"] = result["time_over_matmul_floor"]["seeds_loop"]
    hf_names = [f"hf_{impl}" for impl in args.hf_impls]
    result["passed"] = {
        "vs_transformers_default": result["speedup_of_ours"][hf_names[0]] >= 1.0,
        "vs_transformers_all_impls": all(result["speedup_of_ours"][n] >= 1.0 for n in hf_names),
        "vs_seeds_loop": result["speedup_of_ours"]["seeds_loop"] >= 5.0,
    }
    if args.profile:
        result["profiles"] = {name: _profile(module, x, grad) for name, module in variants.items()}
    path = write_result(args.name, result, args.out_dir)
    print(f"wrote {path}")
    for name, stats in result["forward_backward"].items():
        print(f"  {name:>14}: {stats['tokens_per_s']:9.0f} tokens/s")
    for name, ratio in result["speedup_of_ours"].items():
        print(f"  ours vs {name}: {ratio:.2f}x")
    for name, ratio in result["time_over_matmul_floor"].items():
        print(f"  {name} time / matmul floor: {ratio:.2f}")
    return 0


def _profile(module: nn.Module, x: torch.Tensor, grad: torch.Tensor, rows: int = 12) -> str:
    """Top operators by self CPU time over three forward+backward steps (what limits the variant)."""
    from torch.profiler import ProfilerActivity, profile

    fwd_bwd(module, x, grad)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            fwd_bwd(module, x, grad)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


if __name__ == "__main__":
    raise SystemExit(main())
