"""Causal interventions on MoE routing through forward hooks, one API for every captured architecture.

Each intervention is a context manager over a model; on exit (also on an exception) every hook it
added is removed, and an intervention with nothing to do adds no hook at all, so the model computes
exactly what it did before. Layers are **MoE-layer positions**: ``i`` is the ``i``-th router of
:func:`moee.capture.registry.find_routers` (the ``i``-th column of the recorder's routing weights),
experts are ``(i, e)`` pairs.

* :func:`bias_experts`: add a bias to chosen experts' router logits before the router selects
  (SteerMoE-style steering, Fayyaz et al. 2025); :func:`force_experts` is a bias so large that the
  expert is chosen at every token.
* :func:`disable_experts` with ``mode``:

  - ``"reselect"`` (the default): the expert's logit is set to the most negative float before the
    router's own top-k, so the router picks another expert in its place and weights the selected
    ones by its own rule (renormalisation, scaling, correction biases all as the architecture does
    it): the expert is *pruned*, each token still gets ``k`` experts;
  - ``"zero"``: the router selects as usual, and the expert's weight is set to 0 in the dispatch
    its experts module is called with (each token then gets ``k - 1`` experts where it chose it).
    ``renormalize=True`` rescales the token's remaining selected weights to the total they had
    (what a top-k router that renormalises, e.g. Mixtral or OLMoE with ``norm_topk_prob``, would
    give those experts); ``False`` keeps them as they are.

* :func:`drop_assignments`: the load-matched null of :func:`disable_experts`: at each token
  independently with probability ``rate`` one of its ``k`` selected experts, drawn uniformly, is
  disabled (same two modes); with ``rate`` an expert's selection frequency it removes as many
  assignments as disabling that expert, spread over all experts.
* :func:`swap_routers`: a layer's router (or every layer's) is replaced by the router of another
  model of the same architecture (another checkpoint): the hook returns the donor router's output
  on the same input. Its null, :func:`permute_router`: the layer's own router with its expert order
  permuted (a seeded derangement of its logits' columns): the same distribution of loads over the
  experts, with every token sent to other experts than its own.

How the logits are reached: a router that is an ``nn.Linear`` (or whose logits come from a child
``nn.Linear``, Gemma-4) gets a forward hook that edits that Linear's output. Any other router computes
its logits inside its ``forward``; there a ``torch.overrides.TorchFunctionMode`` is active during
that forward only (entered by a pre-hook, left by an ``always_call`` hook), and the first
``F.linear`` whose weight is the router's ``[E, hidden]`` projection (or a cast of it) gets the bias.
A router whose forward computes no such projection raises ``RuntimeError`` instead of silently doing
nothing. Zero mode needs the experts module to be called with ``(.., indices [N, k], weights [N, k])``
(every transformers 5 fused experts module and moee's own); Llama-4 and JetMoE are not, and get a
``ValueError`` that names ``mode="reselect"``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from moee.capture.registry import RouterSpec, find_routers, selection_bias, selection_scores

__all__ = [
    "DISABLE_MODES",
    "FORCE_BIAS",
    "bias_experts",
    "disable_experts",
    "drop_assignments",
    "force_experts",
    "moe_block",
    "permute_router",
    "router_permutation",
    "swap_routers",
]

#: The two ways of disabling an expert (see the module docstring).
DISABLE_MODES = ("reselect", "zero")
#: The logit bias of :func:`force_experts`: far above any trained logit, finite so no rule meets inf - inf.
FORCE_BIAS = 1.0e4

#: ``bias_fn(logits [N, E] float32) -> additive [N, E] or [E]`` of one router call.
LogitEdit = Callable[[torch.Tensor], torch.Tensor]
#: ``keep_fn(indices [N, k]) -> bool [N, k]``: which dispatched (token, slot) pairs keep their weight.
DispatchEdit = Callable[[torch.Tensor], torch.Tensor]


def _routers(model: nn.Module, routers: Sequence[RouterSpec] | None) -> list[RouterSpec]:
    return list(routers) if routers is not None else find_routers(model)


def _check_pairs(pairs: Iterable[tuple[int, int]], specs: Sequence[RouterSpec]) -> dict[int, list[int]]:
    """``{(layer, expert)}`` -> ``{layer: [experts]}``, each checked against the model's routers."""
    grouped: dict[int, list[int]] = {}
    for pair in pairs:
        try:
            layer, expert = (int(v) for v in pair)
        except (TypeError, ValueError):
            raise ValueError(f"experts are (moe_layer, expert) pairs, got {pair!r}") from None
        if not 0 <= layer < len(specs):
            raise ValueError(
                f"MoE layer {layer} out of range: the model has {len(specs)} MoE layers (0..{len(specs) - 1})"
            )
        if not 0 <= expert < specs[layer].n_experts:
            raise ValueError(
                f"expert {expert} out of range in MoE layer {layer} ({specs[layer].n_experts} experts)"
            )
        grouped.setdefault(layer, [])
        if expert not in grouped[layer]:
            grouped[layer].append(expert)
    return grouped


def moe_block(model: nn.Module, spec: RouterSpec) -> nn.Module:
    """The MoE block holding ``spec``'s router: the nearest ancestor with an ``experts`` child."""
    modules = dict(model.named_modules())
    parts = spec.name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        block = modules.get(".".join(parts[:cut]))
        if block is not None and isinstance(getattr(block, "experts", None), nn.Module):
            return block
    raise ValueError(
        f'no MoE block with an `experts` module above router {spec.name}: mode="zero" needs one; use mode="reselect"'
    )


# --------------------------------------------------------------------------------------------
# The two hook sites
# --------------------------------------------------------------------------------------------


def _projection_weight(spec: RouterSpec) -> torch.Tensor | None:
    router = spec.router
    weight = getattr(router, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[0] >= spec.n_experts:
        return weight
    linears = [m for m in router.modules() if isinstance(m, nn.Linear) and m.out_features == spec.n_experts]
    return linears[0].weight if linears else None


class _LogitMode(TorchFunctionMode):
    """Adds ``edit(logits)`` to the output of the first ``F.linear`` with the router's projection."""

    def __init__(self, weight: torch.Tensor | None, n_experts: int, edit: LogitEdit) -> None:
        super().__init__()
        self.weight, self.n_experts, self.edit = weight, n_experts, edit
        self.hits = 0

    def _is_router_linear(self, args: tuple, kwargs: dict) -> bool:
        weight = args[1] if len(args) > 1 else kwargs.get("weight")
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] < self.n_experts:
            return False
        if self.weight is None:
            return weight.shape[0] == self.n_experts
        return weight is self.weight or weight.shape == self.weight.shape

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is F.linear and self.hits == 0 and self._is_router_linear(args, kwargs):
            self.hits += 1
            edit = self.edit(out[..., : self.n_experts].detach().float()).to(out.dtype)
            if out.shape[-1] > self.n_experts:  # routed columns first, then others (Inkling's shared gates)
                edit = F.pad(
                    edit.expand(*out.shape[:-1], self.n_experts), (0, out.shape[-1] - self.n_experts)
                )
            out = out + edit
        return out


def _logit_hooks(spec: RouterSpec, edit: LogitEdit) -> list:
    """Hooks that add ``edit(logits)`` to ``spec``'s logits before its selection."""
    plain = isinstance(spec.module, nn.Linear) and type(spec.module).forward is nn.Linear.forward
    if plain and spec.module.out_features == spec.n_experts:  # its output is the logits tensor

        def on_linear(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
            return output + edit(output.detach().float()).to(output.dtype)

        return [spec.module.register_forward_hook(on_linear, prepend=True)]

    weight = _projection_weight(spec)
    active: list[_LogitMode] = []

    def enter(module: nn.Module, args: tuple) -> None:
        mode = _LogitMode(weight, spec.n_experts, edit)
        mode.__enter__()
        active.append(mode)

    def leave(module: nn.Module, args: tuple, output):
        if not active:
            return None
        mode = active.pop()
        mode.__exit__(None, None, None)
        if mode.hits == 0:
            raise RuntimeError(
                f"router {spec.name} ({type(spec.router).__name__}) computed no [hidden -> {spec.n_experts}] "
                "projection with F.linear: its logits cannot be edited by this hook"
            )
        return None

    return [
        spec.router.register_forward_pre_hook(enter, prepend=True),
        spec.router.register_forward_hook(leave, prepend=True, always_call=True),
    ]


def _find_dispatch(args: tuple, kwargs: dict) -> tuple[tuple[str, object], tuple[str, object]] | None:
    """Where the ``indices [N, k]`` and ``weights [N, k]`` of an experts call are: (('arg', i) | ('kw', name)) x 2."""
    slots = [("arg", i, v) for i, v in enumerate(args)] + [("kw", k, v) for k, v in kwargs.items()]
    tensors = [(kind, key, v) for kind, key, v in slots if isinstance(v, torch.Tensor)]
    index = next(
        (s for s in tensors if not s[2].is_floating_point() and s[2].dim() == 2 and s[2].dtype != torch.bool),
        None,
    )
    if index is None:
        return None
    weights = next((s for s in tensors if s[2].is_floating_point() and s[2].shape == index[2].shape), None)
    if weights is None:
        return None
    return (index[0], index[1]), (weights[0], weights[1])


def _dispatch_hook(block: nn.Module, spec: RouterSpec, keep_fn: DispatchEdit, renormalize: bool):
    def hook(module: nn.Module, args: tuple, kwargs: dict):
        found = _find_dispatch(args, kwargs)
        if found is None:
            raise ValueError(
                f"the experts of {spec.name} are not called with (indices, weights): "
                'mode="zero" cannot act there; use mode="reselect"'
            )
        (ik, ikey), (wk, wkey) = found
        index = args[ikey] if ik == "arg" else kwargs[ikey]
        weights = args[wkey] if wk == "arg" else kwargs[wkey]
        keep = keep_fn(index)
        new = torch.where(keep, weights, torch.zeros_like(weights))
        if renormalize:
            total, left = weights.sum(-1, keepdim=True), new.sum(-1, keepdim=True)
            new = torch.where(
                left != 0, new * (total / torch.where(left != 0, left, torch.ones_like(left))), new
            )
        if wk == "arg":
            args = (*args[:wkey], new, *args[wkey + 1 :])
        else:
            kwargs = {**kwargs, wkey: new}
        return args, kwargs

    return block.experts.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)


@contextlib.contextmanager
def _hooked(make: Callable[[], list]) -> Iterator[None]:
    handles: list = []
    try:
        handles.extend(make())
        yield
    finally:
        for handle in handles:
            handle.remove()


# --------------------------------------------------------------------------------------------
# The interventions
# --------------------------------------------------------------------------------------------


def _bias_vector(spec: RouterSpec, experts: Mapping[int, float]) -> torch.Tensor:
    bias = torch.zeros(spec.n_experts)
    for e, value in experts.items():
        bias[e] = float(value)
    return bias


@contextlib.contextmanager
def bias_experts(
    model: nn.Module,
    biases: Mapping[tuple[int, int], float],
    *,
    routers: Sequence[RouterSpec] | None = None,
) -> Iterator[None]:
    """Add ``biases[(layer, expert)]`` to those experts' router logits before the router selects."""
    specs = _routers(model, routers)
    values = {(int(layer), int(expert)): float(v) for (layer, expert), v in biases.items()}
    grouped = _check_pairs(values, specs)
    per_layer = {i: _bias_vector(specs[i], {e: values[(i, e)] for e in es}) for i, es in grouped.items()}
    per_layer = {i: b for i, b in per_layer.items() if bool(b.ne(0).any())}

    def make() -> list:
        handles = []
        for i, bias in per_layer.items():
            handles += _logit_hooks(specs[i], lambda logits, b=bias: b.to(logits.device))
        return handles

    with _hooked(make):
        yield


def force_experts(
    model: nn.Module, experts: Iterable[tuple[int, int]], *, routers: Sequence[RouterSpec] | None = None
):
    """Make the router choose ``experts`` at every token (a logit bias of :data:`FORCE_BIAS`)."""
    return bias_experts(model, {tuple(p): FORCE_BIAS for p in experts}, routers=routers)


@contextlib.contextmanager
def disable_experts(
    model: nn.Module,
    experts: Iterable[tuple[int, int]],
    *,
    mode: str = "reselect",
    renormalize: bool = False,
    routers: Sequence[RouterSpec] | None = None,
) -> Iterator[None]:
    """Disable ``experts`` (``(layer, expert)`` pairs): ``mode="reselect"`` masks their logits before
    the router's top-k, ``"zero"`` zeroes their dispatch weight (``renormalize``: the token's other
    selected weights keep its total). See the module docstring."""
    if mode not in DISABLE_MODES:
        raise ValueError(f"mode must be one of {DISABLE_MODES}, got {mode!r}")
    if mode == "reselect" and renormalize:
        raise ValueError(
            'renormalize applies to mode="zero"; in "reselect" mode the router weights by its own rule'
        )
    specs = _routers(model, routers)
    grouped = _check_pairs(experts, specs)

    def make() -> list:
        handles = []
        for i, es in grouped.items():
            spec = specs[i]
            if len(es) >= spec.n_experts:
                raise ValueError(f"cannot disable all {spec.n_experts} experts of MoE layer {i}")
            if mode == "reselect":
                mask = torch.zeros(spec.n_experts, dtype=torch.bool)
                mask[es] = True

                def edit(logits: torch.Tensor, mask=mask) -> torch.Tensor:
                    return torch.where(mask.to(logits.device), torch.finfo(logits.dtype).min, 0.0)

                handles += _logit_hooks(spec, edit)
            else:
                chosen = torch.tensor(es)

                def keep(index: torch.Tensor, chosen=chosen) -> torch.Tensor:
                    return ~torch.isin(index, chosen.to(index.device))

                handles.append(_dispatch_hook(moe_block(model, spec), spec, keep, renormalize))
        return handles

    with _hooked(make):
        yield


def _draw_slots(n: int, k: int, rate: float, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: whether one slot is dropped (prob ``rate``) and which of the ``k`` (uniform)."""
    drop = torch.rand(n, generator=generator) < rate
    slot = torch.randint(k, (n,), generator=generator)
    return drop, slot


@contextlib.contextmanager
def drop_assignments(
    model: nn.Module,
    layer: int,
    rate: float,
    *,
    mode: str = "reselect",
    renormalize: bool = False,
    seed: int = 0,
    routers: Sequence[RouterSpec] | None = None,
) -> Iterator[None]:
    """The load-matched null: in MoE layer ``layer``, each token with probability ``rate`` loses one
    of its ``k`` selected experts (uniform over its slots), in ``mode`` like :func:`disable_experts`.

    The draws come from a generator seeded with ``seed`` and advance call by call, so a fixed corpus
    order gives the same null twice."""
    if mode not in DISABLE_MODES:
        raise ValueError(f"mode must be one of {DISABLE_MODES}, got {mode!r}")
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"rate must be in [0, 1], got {rate}")
    specs = _routers(model, routers)
    if not 0 <= layer < len(specs):
        raise ValueError(f"MoE layer {layer} out of range: the model has {len(specs)} MoE layers")
    spec = specs[layer]
    generator = torch.Generator().manual_seed(seed)

    def make() -> list:
        if rate == 0.0:
            return []
        if mode == "reselect":
            if spec.top_k is None:
                raise ValueError(f"router {spec.name} declares no top-k: the null cannot tell its selection")
            bias_of = selection_bias(spec.router)

            def edit(logits: torch.Tensor) -> torch.Tensor:
                flat = logits.reshape(-1, logits.shape[-1])
                ranked = selection_scores(flat, spec.rule, spec.router, bias_of)
                top = ranked.topk(spec.top_k, dim=-1).indices
                drop, slot = _draw_slots(flat.shape[0], spec.top_k, rate, generator)
                victim = top.gather(-1, slot.to(top.device)[:, None])[:, 0]
                out = torch.zeros_like(flat)
                rows = torch.nonzero(drop.to(flat.device))[:, 0]
                out[rows, victim[rows]] = torch.finfo(out.dtype).min
                return out.reshape(logits.shape)

            return _logit_hooks(spec, edit)

        def keep(index: torch.Tensor) -> torch.Tensor:
            drop, slot = _draw_slots(index.shape[0], index.shape[1], rate, generator)
            hit = torch.zeros(index.shape, dtype=torch.bool)
            hit[torch.arange(index.shape[0]), slot] = drop
            return ~hit.to(index.device)

        return [_dispatch_hook(moe_block(model, spec), spec, keep, renormalize)]

    with _hooked(make):
        yield


@contextlib.contextmanager
def swap_routers(
    model: nn.Module,
    donor: nn.Module,
    layers: Iterable[int] | None = None,
    *,
    routers: Sequence[RouterSpec] | None = None,
) -> Iterator[None]:
    """Route MoE layers ``layers`` (all when ``None``) of ``model`` with ``donor``'s routers.

    ``donor`` is a model of the same architecture (another checkpoint); its router at the same
    MoE-layer position must be of the same class with parameters of the same shapes."""
    specs = _routers(model, routers)
    donors = find_routers(donor)
    if len(donors) != len(specs):
        raise ValueError(
            f"the donor has {len(donors)} MoE layers, the model {len(specs)}: not the same architecture"
        )
    chosen = sorted(set(range(len(specs)) if layers is None else (int(i) for i in layers)))
    for i in chosen:
        if not 0 <= i < len(specs):
            raise ValueError(f"MoE layer {i} out of range: the model has {len(specs)} MoE layers")
        mine, theirs = specs[i].module, donors[i].module
        shapes = [p.shape for p in mine.parameters()], [p.shape for p in theirs.parameters()]
        if type(mine) is not type(theirs) or shapes[0] != shapes[1]:
            raise ValueError(
                f"MoE layer {i}: the donor's router ({type(theirs).__name__}, {shapes[1]}) does not match "
                f"the model's ({type(mine).__name__}, {shapes[0]})"
            )

    def make() -> list:
        handles = []
        for i in chosen:
            theirs = donors[i].module

            def hook(module: nn.Module, args: tuple, kwargs: dict, output, theirs=theirs):
                return theirs(*args, **kwargs)

            handles.append(specs[i].module.register_forward_hook(hook, with_kwargs=True, prepend=True))
        return handles

    with _hooked(make):
        yield


def router_permutation(n_experts: int, seed: int) -> torch.Tensor:
    """A derangement of ``range(n_experts)`` drawn from a generator seeded with ``seed`` (uniform
    permutations redrawn until none keeps an expert in place, so the draw is a function of ``seed``)."""
    if n_experts < 2:
        raise ValueError(f"a router of {n_experts} expert(s) has no other order to permute to")
    generator = torch.Generator().manual_seed(seed)
    while True:
        perm = torch.randperm(n_experts, generator=generator)
        if not bool((perm == torch.arange(n_experts)).any()):
            return perm


@contextlib.contextmanager
def permute_router(
    model: nn.Module,
    layers: Iterable[int] | None = None,
    *,
    seed: int = 0,
    routers: Sequence[RouterSpec] | None = None,
) -> Iterator[None]:
    """Route MoE layers ``layers`` (all when ``None``) with their own router's logits in a permuted
    expert order: expert ``e`` gets the logit of expert ``perm[e]``, ``perm`` =
    :func:`router_permutation` ``(E, seed + layer)``. The router then selects and weights by its own
    rule, so the loads are the unpermuted ones permuted and which expert serves which token is
    arbitrary (a per-expert selection bias, e.g. DeepSeek's correction bias, stays in place).

    The null of :func:`swap_routers`: what a router that keeps the load but not the assignment costs."""
    specs = _routers(model, routers)
    chosen = sorted(set(range(len(specs)) if layers is None else (int(i) for i in layers)))
    for i in chosen:
        if not 0 <= i < len(specs):
            raise ValueError(f"MoE layer {i} out of range: the model has {len(specs)} MoE layers")
    perms = {i: router_permutation(specs[i].n_experts, seed + i) for i in chosen}

    def make() -> list:
        handles = []
        for i, perm in perms.items():

            def edit(logits: torch.Tensor, perm=perm) -> torch.Tensor:
                return logits[..., perm.to(logits.device)] - logits

            handles += _logit_hooks(specs[i], edit)
        return handles

    with _hooked(make):
        yield
