"""Upcycling: turn a dense Hugging Face checkpoint into a moee MoE model.

``from moee.moe.upcycle import upcycle`` then ``upcycle(src, n_experts=8, top_k=2, mode="split")``.

* ``mode="copy"`` — sparse upcycling (Komatsuzaki et al., ICLR 2023): every expert is a copy of the
  layer's FFN; the router starts at random (or zero). Any routing reproduces the dense model.
* ``mode="split"`` — MoEfication (Zhang et al., 2022) / LLaMA-MoE: the FFN's ``d_ff`` neurons are
  partitioned into ``n_experts`` experts of exactly ``d_ff / n_experts`` neurons each, by balanced
  k-means on the neurons' input-weight vectors (the rows feeding the activation). The router
  starts at the cluster centroids (an expert scores ``x . mean(input rows of its neurons)``, a proxy
  of how strongly its neurons fire) or at random. With ``top_k = n_experts`` the MoE equals the
  dense model.
* Shared experts: in split mode ``shared_neurons`` neurons (the largest by weight norm, or the most
  central by direction) are removed from the partition and kept always on; in copy mode
  ``shared_copy=True`` adds a copy of the FFN that is always on (the routed and shared halves are
  averaged, so equivalence still holds).

The result is a `moee.moe.upcycled.MoEEUpcycledForCausalLM` (decoders) or `MoEEUpcycledModel`
(encoders); ``save_upcycled`` writes it with safetensors, together with the source tokenizer.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from moee.io import FolderOutput
from moee.moe.gate_registry import load_router_weight
from moee.moe.layer import COLLAPSE_MAX_OVER_MEAN
from moee.moe.upcycled import (
    FAMILIES,
    DenseFFN,
    MoEEUpcycledConfig,
    MoEEUpcycledForCausalLM,
    MoEEUpcycledModel,
    MoEEUpcycledPreTrainedModel,
    family_rule,
    is_causal,
    moe_layers,
    reorder_layers,
)
from moee.upcycle_settings import ROUTER_INITS, UpcycleSettings
from moee.upcycle_settings import check_layer_order as _check_layer_order

__all__ = [
    "COLLAPSE_MAX_OVER_MEAN",
    "ROUTER_INITS",
    "SHARED_SELECTIONS",
    "UpcycleSettings",
    "UpcycleWarning",
    "balance_routers",
    "balanced_assign",
    "balanced_kmeans",
    "calibration_texts",
    "select_shared_neurons",
    "router_load_report",
    "split_neurons",
    "upcycle",
    "upcycle_to_folder",
    "save_upcycled",
]

SHARED_SELECTIONS = ("norm", "central")


class UpcycleWarning(UserWarning):
    """An upcycled model that builds but will train badly (e.g. a router that starts collapsed)."""


def balanced_assign(dist: torch.Tensor, size: int) -> torch.Tensor:
    """Assign each of ``n`` points to one of ``C`` clusters, exactly ``size`` points per cluster.

    ``dist [n, C]`` (``n == C * size``). In rounds, every unassigned point proposes to its nearest
    cluster that still has room, and each cluster accepts its closest proposers up to its room
    (a vectorised form of the greedy "closest pair first" balanced assignment of MoEfication).
    Every round fills at least one cluster or places every proposer, so at most ``C`` rounds.
    """
    n, n_clusters = dist.shape
    if n != n_clusters * size:
        raise ValueError(f"{n} points cannot fill {n_clusters} clusters of {size}")
    labels = torch.full((n,), -1, dtype=torch.long)
    room = torch.full((n_clusters,), size, dtype=torch.long)
    while True:
        free = torch.nonzero(labels < 0).squeeze(1)
        if free.numel() == 0:
            return labels
        d = dist[free].masked_fill((room == 0).unsqueeze(0), float("inf"))
        best, choice = d.min(dim=1)
        order = torch.argsort(best, stable=True)
        order = order[torch.argsort(choice[order], stable=True)]  # by cluster, closest first
        ranked = choice[order]
        start = torch.searchsorted(ranked, ranked, side="left")
        rank = torch.arange(len(order)) - start
        accept = order[rank < room[ranked]]
        labels[free[accept]] = choice[accept]
        room -= torch.bincount(choice[accept], minlength=n_clusters)


def balanced_kmeans(
    points: torch.Tensor, n_clusters: int, *, n_iter: int = 30, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partition ``points [n, d]`` into ``n_clusters`` clusters of exactly ``n / n_clusters`` points.

    Lloyd iterations whose assignment step is capacity-constrained (:func:`balanced_assign`).
    Initial centroids are ``n_clusters`` distinct points drawn with ``seed``. Returns ``(labels [n] long, centroids [n_clusters, d])``,
    centroids being the means of the final clusters. Deterministic for a given seed.
    """
    n = points.shape[0]
    if n_clusters < 1 or n % n_clusters:
        raise ValueError(f"{n} points cannot be split into {n_clusters} clusters of equal size")
    size = n // n_clusters
    x = points.detach().float()
    sq = x.square().sum(1, keepdim=True)
    gen = torch.Generator().manual_seed(seed)
    centroids = x[torch.randperm(n, generator=gen)[:n_clusters]].clone()
    labels = torch.full((n,), -1, dtype=torch.long)
    for _ in range(n_iter):
        dist = sq - 2 * x @ centroids.t() + centroids.square().sum(1)  # squared distances [n, C]
        new = balanced_assign(dist, size)
        centroids = x.new_zeros(n_clusters, x.shape[1]).index_add_(0, new, x) / size
        if torch.equal(new, labels):
            break
        labels = new
    return labels, centroids.to(points.dtype)


def select_shared_neurons(dense: DenseFFN, n_shared: int, how: str = "norm") -> torch.Tensor:
    """The ``n_shared`` neurons to keep always on (sorted indices).

    ``"norm"``: the largest ``|input rows| * |output column|`` (a data-free proxy for the neurons
    that contribute most); ``"central"``: the highest cosine between the neuron's activation-input
    row and the mean direction of all rows (the most generic neurons).
    """
    if how not in SHARED_SELECTIONS:
        raise ValueError(f"shared-neuron selection must be one of {SHARED_SELECTIONS}, got {how!r}")
    if not 0 <= n_shared < dense.d_ff:
        raise ValueError(f"shared_neurons must be in [0, d_ff={dense.d_ff}), got {n_shared}")
    if how == "norm":
        score = dense.w_act.norm(dim=1) * dense.w_down.norm(dim=0)
        if dense.w_up is not None:
            score = score * dense.w_up.norm(dim=1)
    else:
        unit = torch.nn.functional.normalize(dense.w_act.double(), dim=1)
        score = unit @ torch.nn.functional.normalize(unit.mean(0), dim=0)
    return torch.sort(torch.topk(score, n_shared).indices).values


def split_neurons(
    dense: DenseFFN, n_experts: int, shared: torch.Tensor | None = None, *, seed: int = 0
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Balanced k-means over the activation-input rows of the neurons not in ``shared``.

    Returns ``(groups, centroids)``: ``groups[e]`` the sorted neuron indices of expert ``e`` (all of
    equal size) and ``centroids [n_experts, d]`` the mean input row of each group.
    """
    pool = torch.arange(dense.d_ff)
    if shared is not None and len(shared):
        pool = pool[~torch.isin(pool, shared)]
    if len(pool) % n_experts:
        extra = f" after removing {dense.d_ff - len(pool)} shared neurons" if len(pool) != dense.d_ff else ""
        raise ValueError(
            f"d_ff={len(pool)}{extra} is not divisible by n_experts={n_experts}: "
            "every expert must get the same number of neurons"
        )
    labels, centroids = balanced_kmeans(dense.w_act[pool], n_experts, seed=seed)
    groups = [pool[labels == e] for e in range(n_experts)]
    return groups, centroids


def _load_dense(
    src: str | Path | PreTrainedModel,
    dtype: torch.dtype | None,
    causal: bool = False,
    layer_order: list[int] | None = None,
) -> PreTrainedModel:
    if isinstance(src, PreTrainedModel):
        _check_layer_order(layer_order, getattr(src.config, "num_hidden_layers", None))
        if causal and not is_causal(src.config):
            raise ValueError(
                "causal=True needs a path or name (the causal LM class is built at load time); "
                "load the encoder with is_decoder=True yourself or pass its path"
            )
        return src
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    from moee.loading import check_model_source

    check_model_source(src)
    config = AutoConfig.from_pretrained(src)
    family_rule(config.model_type)
    _check_layer_order(layer_order, getattr(config, "num_hidden_layers", None))
    if causal and not is_causal(config):
        # an encoder family as a causal LM: causal self-attention and the family's LM head
        # (its prediction-head weights start fresh when the checkpoint has none)
        config.is_decoder = True
    auto = AutoModelForCausalLM if is_causal(config) else AutoModel
    kwargs = {"dtype": dtype} if dtype is not None else {}
    # weights the checkpoint lacks (an encoder's new LM head) are drawn from torch's global
    # generator: upcycle() seeds it, so the same seed gives the same model
    return auto.from_pretrained(src, config=config, use_safetensors=True, **kwargs)


def upcycle(
    src: str | Path | PreTrainedModel,
    settings: UpcycleSettings | None = None,
    *,
    calibration: torch.Tensor | None = None,
    calibration_mask: torch.Tensor | None = None,
    tokenizer: Any = None,
    **keywords: Any,
) -> MoEEUpcycledPreTrainedModel:
    """Build an MoE model from a dense checkpoint (a path / hub name, or a loaded model).

    ``settings`` (:class:`moee.upcycle_settings.UpcycleSettings`, checked when built) says how; a
    Python caller may give its keywords instead (``n_experts``, ``top_k``, ``mode="split"``,
    ``shared_neurons=0``, ``shared_select="norm"``, ``shared_copy=False``, ``router_init=None``,
    ``router_std=0.02``, ``seed=0``, ``dtype=None``, ``causal=False``, ``layer_order=None``,
    ``router_type="loss_free"``, ``router_bias_gamma=1e-3``, ``router_options=None``,
    ``balance_router=True``, ``lora_rank=8``: `UpcycleSettings.from_keywords`), which build the same
    settings and name their errors by keyword.

    ``src`` must be a Llama / Mistral / Qwen2 / Qwen3 / GPT-2 causal LM or a BERT / RoBERTa encoder
    (``moee.moe.upcycled.FAMILIES``); its weights are read from safetensors only. ``router_init``
    defaults to ``"centroid"`` for split and ``"random"`` (normal, std ``router_std``) for copy;
    ``"zero"`` starts from uniform routing. ``mode="lora"`` keeps the whole FFN once and gives every
    expert a rank-``lora_rank`` adapter of its down projection (A seeded random, B zero: the model
    starts as the dense one); its router defaults to ``"centroid"`` over the FFN's neuron clusters
    (the split mode's router, used here only to route). A loaded ``src`` model is modified in place (its FFN
    modules are replaced) and becomes the returned model's ``.model``.

    ``causal=True`` turns an encoder family (BERT, RoBERTa) into a causal LM before upcycling
    (``is_decoder=True``: causal self-attention and the family's LM head, tied to the input
    embeddings), so it loads with ``AutoModelForCausalLM``. ``layer_order`` applies depth
    up-scaling first (`moee.moe.upcycled.reorder_layers`, e.g. ``[0, 1, 2, 3, 2, 3, 4, 5]``).
    ``router_type`` is any gate of `moee.moe.gate_registry.GATES` (the names the from-scratch LM
    uses; by default ``loss_free``: softmax scores, top-k selection with a per-expert bias that
    training moves towards balanced load, step ``router_bias_gamma``, and that starts at zero, so
    an untrained model computes what ``noisy_top_k`` without noise (the deterministic top-k softmax
    gate) does; unlike that gate it keeps the load balanced while the model trains, which no
    noise-free gate's balancing loss does: docs/UPCYCLING.md); ``router_options`` sets its other ``router_*`` fields
    (`moee.moe.gate_registry.RouterFields`, e.g. ``{"router_n_groups": 4}`` for ``hierarchical``;
    a ``router_bias_gamma`` there wins over the argument).

    Every random draw (k-means starts, a random router, weights the checkpoint lacks such as an
    encoder's new LM head, the gates' own init) comes from ``seed``: the same call gives the same
    model, and the caller's torch generator state is left as it was.

    Routers start balanced: the FFN inputs of one layer share a large common component (the
    LayerNorm bias, position terms), and a router row's projection on it decides the top-k for
    almost every token (one expert with most of the load, dead experts). ``balance_router``
    (default on, for every gate) removes that component from every router row and
    then settles a per-expert offset until the layer's own gate loads the experts evenly
    (`balance_routers`), layer by layer, on the first three quarters of ``calibration`` (token
    ids ``[n, L]``, ``calibration_mask`` its attention mask; default `calibration_texts` through
    ``tokenizer``, else seeded random ids: `_calibration_sample`). The per-layer load on the last
    quarter, which the balancing did not see, is kept as ``model.router_load_report``
    (`router_load_report`), and a collapsed layer (max/mean load above
    `COLLAPSE_MAX_OVER_MEAN`, or a dead expert) raises an `UpcycleWarning`.
    """
    if settings is None:  # every value checked there, before the dense model loads
        settings = UpcycleSettings.from_keywords(**keywords)
    elif keywords:
        raise TypeError(f"upcycle takes settings or keywords, not both: got {', '.join(sorted(keywords))}")
    seed = settings.seed
    layer_order = list(settings.layer_order) if settings.layer_order is not None else None
    dtype = getattr(torch, settings.dtype) if settings.dtype is not None else None
    router_init = settings.router_init or ("random" if settings.mode == "copy" else "centroid")

    # every random draw below comes from `seed`; the caller's generator state is restored after.
    # Every draw is made on the CPU, so only its generator is seeded (torch.manual_seed would also
    # reseed the caller's CUDA generators, which fork_rng(devices=[]) does not restore)
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(seed)
        dense_model = _load_dense(src, dtype, settings.causal, layer_order)
        rule = family_rule(getattr(dense_model.config, "model_type", None))
        if layer_order is not None:
            reorder_layers(dense_model, list(layer_order))
        ffns = [rule.read(layer) for layer in moe_layers(dense_model.base_model, rule)]
        d_ff = ffns[0].d_ff
        widths = _expert_widths(settings, d_ff)
        gen = torch.Generator().manual_seed(seed)
        # ffn holds (detached) references to the dense tensors: they outlive the replaced modules
        plans = [_layer_plan(ffn, settings, router_init, d_ff, gen) for ffn in ffns]
        model = _assemble(src, dense_model, settings, router_init, widths, plans)
        model.eval()
        if tokenizer is None and calibration is None and isinstance(src, (str, Path)):
            tokenizer = _local_tokenizer(Path(src))
        sample, mask = _calibration_sample(model, calibration, calibration_mask, seed, tokenizer)
        fit, held = _split_sample(len(sample))
        if settings.router_balance:
            balance_routers(model, [plan[3] for plan in plans], sample[fit], mask[fit])
        report = router_load_report(model, sample[held], mask[held])
    model.router_load_report = report
    message = _collapse_message(report)
    if message:
        warnings.warn(message, UpcycleWarning, stacklevel=2)
    return model


def _expert_widths(settings: UpcycleSettings, d_ff: int) -> tuple[int, int]:
    """The (shared, per-expert) FFN widths of the mode; split checks that the neurons divide evenly."""
    mode, n_experts, shared_neurons = settings.mode, settings.experts, settings.shared_neurons
    if mode == "split":
        if not 0 <= shared_neurons < d_ff:
            raise ValueError(f"shared_neurons must be in [0, d_ff={d_ff}), got {shared_neurons}")
        if (d_ff - shared_neurons) % n_experts:
            raise ValueError(
                f"d_ff={d_ff} minus shared_neurons={shared_neurons} is not divisible by n_experts={n_experts}: "
                "every expert must get the same number of neurons"
            )
        return shared_neurons, (d_ff - shared_neurons) // n_experts
    if mode == "lora":
        return d_ff, d_ff
    return (d_ff if settings.shared_copy else 0), d_ff


def _layer_plan(
    ffn: DenseFFN, settings: UpcycleSettings, router_init: str, d_ff: int, gen: torch.Generator
) -> tuple:
    """One dense FFN's ``(ffn, expert neuron groups, shared neurons, router rows, LoRA A)``.

    Called layer by layer in order: the draws from ``gen`` follow the same sequence every call.
    """
    mode, n_experts, seed = settings.mode, settings.experts, settings.seed
    if mode == "split":
        n_shared = settings.shared_neurons
        shared = select_shared_neurons(ffn, n_shared, settings.shared_select) if n_shared else None
        groups, centroids = split_neurons(ffn, n_experts, shared, seed=seed)
    elif mode == "lora":  # the whole FFN is shared; neuron clusters only start the router
        shared = torch.arange(d_ff)
        groups = None
        centroids = split_neurons(ffn, n_experts, seed=seed)[1] if router_init == "centroid" else None
    else:
        shared = torch.arange(d_ff) if settings.shared_copy else None
        groups, centroids = [torch.arange(d_ff)] * n_experts, None
    if router_init == "centroid":
        router = centroids
    elif router_init == "random":
        router = torch.randn(n_experts, ffn.d_model, generator=gen, dtype=torch.float32) * settings.router_std
    else:
        router = torch.zeros(n_experts, ffn.d_model)
    lora_a = None
    if mode == "lora":  # LoRA's A: kaiming-uniform-like rows of scale 1/sqrt(d_ff)
        bound = 1.0 / math.sqrt(d_ff)
        lora_a = (torch.rand(n_experts, d_ff, settings.lora_rank, generator=gen) * 2 - 1) * bound
    return ffn, groups, shared, router, lora_a


def _assemble(
    src: str | Path | PreTrainedModel,
    dense_model: PreTrainedModel,
    settings: UpcycleSettings,
    router_init: str,
    widths: tuple[int, int],
    plans: list[tuple],
) -> MoEEUpcycledPreTrainedModel:
    """The upcycled model around ``dense_model``, each MoE FFN loaded from its layer's plan."""
    text_config = dense_model.config
    expected = MoEEUpcycledForCausalLM if is_causal(text_config) else MoEEUpcycledModel
    shared_width, width = widths
    mode = settings.mode
    name = src if isinstance(src, (str, Path)) else getattr(text_config, "_name_or_path", None)
    config = MoEEUpcycledConfig(
        text_config=text_config,
        num_experts=settings.experts,
        num_experts_per_tok=settings.top_k,
        upcycle_mode=mode,
        expert_lora_rank=settings.lora_rank if mode == "lora" else 0,
        expert_intermediate_size=width,
        shared_intermediate_size=shared_width,
        router_init=router_init,
        upcycled_from=str(name) if name else None,
        **settings.router_config,
    )
    model = expected(config, dense=dense_model)
    for moe, (ffn, groups, shared, router, lora_a) in zip(model.moe_ffns(), plans, strict=True):
        like = {"device": ffn.w_act.device, "dtype": ffn.w_act.dtype}
        moe.to(**like)
        moe.load_dense(ffn, groups, shared, router.to(**like), None if lora_a is None else lora_a.to(**like))
    return model


def _collapse_message(report: list[dict]) -> str | None:
    """The warning naming the layers whose routers start collapsed, or None when none did."""
    collapsed = [
        f"layer {r['layer']} (max/mean {r['max_over_mean']:.2f}, {r['dead']} dead)"
        for r in report
        if r["collapsed"]
    ]
    if not collapsed:
        return None
    return (
        f"the upcycled routers start collapsed in {len(collapsed)} of {len(report)} layers on the "
        f"calibration sample's unseen quarter: {'; '.join(collapsed)} (ceiling {report[0]['ceiling']:.2f} = experts / "
        "top-k); training reinforces a collapse: keep the router balancing on, balance on text like the "
        "model's own (calibration), and train with a loss_free router"
    )


def calibration_texts(n: int = 256, corpus: str | Path | None = None) -> list[str]:
    """The first ``n`` texts of ``corpus`` (JSONL, ``{"text": ...}`` per line), by default of the
    minilm-moe's held-out sample (406 documents from nine sources: fortunes, WordNet
    glosses, Shakespeare, Python's documentation, Austen, web pages, the King James Bible,
    Wikipedia, the Jargon File; shipped with the package): text of many kinds that needs no
    download and is no evaluation data, for balancing and measuring routers when the caller gives
    none. Routers balanced on one kind of text (Python's documentation alone) start far less even
    on others (docs/UPCYCLING.md, "Router start")."""
    from itertools import islice

    from moee.io import iter_jsonl

    if corpus is None:
        from moee.loading import MINILM_MOE_DIR

        corpus = MINILM_MOE_DIR / "heldout.jsonl"
    return [row["text"] for _, row in islice(iter_jsonl(corpus), n)]


def _local_tokenizer(folder: Path) -> Any:
    """The tokenizer saved in the local model folder ``folder``, or None (a hub name or a folder
    without one: the calibration falls back to random ids)."""
    if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def _calibration_sample(
    model: MoEEUpcycledPreTrainedModel,
    ids: torch.Tensor | None,
    mask: torch.Tensor | None,
    seed: int,
    tokenizer: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The token ids ``[n, L]`` and attention mask the routers are balanced and measured on
    (`_split_sample`):
    ``ids`` as given; else `calibration_texts` through ``tokenizer`` (32 tokens at most); else,
    without a tokenizer, 64 sequences of 32 vocabulary ids drawn with ``seed`` (a weaker sample:
    random ids miss much of the common component real text shares)."""
    vocab = model.get_input_embeddings().weight.shape[0]
    if ids is None and tokenizer is not None:
        enc = tokenizer(
            calibration_texts(), padding=True, truncation=True, max_length=32, return_tensors="pt"
        )
        ids, mask = enc["input_ids"], enc["attention_mask"]
    if ids is None:
        ids = torch.randint(0, vocab, (64, 32), generator=torch.Generator().manual_seed(seed))
    ids = torch.as_tensor(ids, dtype=torch.long)
    if ids.dim() != 2 or ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise ValueError(
            f"calibration must be token ids [n, L] in [0, {vocab}), got shape {tuple(ids.shape)}"
        )
    mask = torch.ones_like(ids) if mask is None else torch.as_tensor(mask, dtype=torch.long)
    if mask.shape != ids.shape:
        raise ValueError(f"calibration_mask must have the shape of calibration {tuple(ids.shape)}")
    return ids, mask


def _forward_base(model: MoEEUpcycledPreTrainedModel, ids: torch.Tensor, mask: torch.Tensor) -> None:
    """The base model's forward (no LM head: the routers are all that is read)."""
    device = model.get_input_embeddings().weight.device
    for start in range(0, len(ids), 16):
        model.model.base_model(
            input_ids=ids[start : start + 16].to(device), attention_mask=mask[start : start + 16].to(device)
        )


def _split_sample(n: int) -> tuple[slice, slice]:
    """The rows of an ``n``-row calibration sample the routers are balanced on (the first three
    quarters) and the rows their start load is reported on (the last quarter, unseen by the
    balancing); a sample of fewer than 4 rows is used whole for both."""
    if n < 4:
        return slice(None), slice(None)
    cut = n - n // 4
    return slice(None, cut), slice(cut, None)


def _selections(out: tuple) -> torch.Tensor:
    """The experts one router call selected, from its output ``(logits, weights, indices,
    gate_out)``: ``indices`` with the slots the gate masks out (e.g. over capacity) set to -1."""
    indices, gate_out = out[2], out[3]
    slot = gate_out.mask if getattr(gate_out, "mask", None) is not None else torch.ones_like(indices)
    return torch.where(slot.bool(), indices, -1)


#: Rounds of the per-expert offset update of `balance_routers`, its step (in standard deviations
#: of the centred router scores) and the floor of a load ratio in its logarithm (dead experts).
_SETTLE_ROUNDS, _SETTLE_STEP, _SETTLE_FLOOR = 300, 0.05, 0.05


def balance_routers(
    model: MoEEUpcycledPreTrainedModel, weights: list[torch.Tensor], ids: torch.Tensor, mask: torch.Tensor
) -> None:
    """Start every router from ``weights[i]`` (``[E, d]``, a row per expert) minus the rows'
    component along the mean FFN input ``m`` of layer ``i`` on the sample ``ids``, plus per-expert
    offsets along ``m`` settled until the layer's own gate loads every expert evenly on the sample.

    ``x . w_e = (x - m) . w_e + m . w_e``: the shared mean adds a per-expert constant to every
    token's score that is far larger than the token-specific part, so a raw centroid router sends
    nearly every token to the same experts. With ``m . w_e = 0`` a token's top-k depends on how it
    differs from the average token; but the rest of the inputs' spread is anisotropic too (a few
    directions carry most of it), so some rows still win far more often (max/mean 2.5-4.2 of 8
    with 32 experts). A row ``w_e + b_e m / |m|^2`` scores ``b_e`` more on the average token:
    the offsets ``b`` are the selection bias of the loss-free balancer (``b_e -= step * spread *
    log(load_e / mean load)``, the best of `_SETTLE_ROUNDS` rounds kept), folded into the rows so
    that every gate, biased or not, keeps it; the selection is the gate's own (top-k, groups,
    capacity), called on the captured inputs. Layers are balanced in order, each on the inputs the
    already balanced layers below it produce.

    One forward pass over the whole sample does it (cost linear in depth): a pre-hook on each MoE
    FFN balances that layer's router on the inputs it is about to route, before it routes them.
    """
    with torch.no_grad():  # a context, not a decorator: mutmut does not mutate decorated functions
        flat_mask = mask.reshape(-1).bool()
        ffns = model.moe_ffns()
        if len(ffns) != len(weights):
            raise ValueError(f"{len(weights)} router weights for {len(ffns)} MoE layers")

        def settle(ffn: Any, weight: torch.Tensor) -> Callable:
            def hook(_module, args):
                x = args[0].reshape(-1, args[0].shape[-1]).detach().double().cpu()[flat_mask]
                m = x.mean(0)
                w = weight.double().cpu()
                w = w - torch.outer(w @ m, m) / m.dot(m).clamp_min(1e-30)
                rows = _settle_offsets(ffn, x, w, m / m.dot(m).clamp_min(1e-30))
                gate_weight = next(ffn.router.gate.parameters())
                load_router_weight(
                    ffn.router_type, ffn.router.gate, rows.to(gate_weight.dtype).to(gate_weight.device)
                )

            return hook

        handles = [ffn.register_forward_pre_hook(settle(ffn, w)) for ffn, w in zip(ffns, weights)]
        try:
            device = model.get_input_embeddings().weight.device
            model.model.base_model(input_ids=ids.to(device), attention_mask=mask.to(device))
        finally:
            for handle in handles:
                handle.remove()


def _settle_offsets(ffn: Any, x: torch.Tensor, w: torch.Tensor, along: torch.Tensor) -> torch.Tensor:
    """The rows ``w + b along`` (``b`` one offset per expert) whose selection by ``ffn``'s own gate
    on the inputs ``x [N, d]`` is the most even of `_SETTLE_ROUNDS` rounds of ``b_e -= step *
    spread * log(load_e / mean load)`` (``spread``: the standard deviation of the centred scores
    ``(x - mean) . w``). Leaves the gate loaded with the last rounds' rows."""
    gate_weight = next(ffn.router.gate.parameters())
    inputs = x.to(gate_weight.dtype).to(gate_weight.device)
    n_experts = ffn.router.num_experts
    spread = float(((x - x.mean(0)) @ w.T).std()) if len(x) > 1 else 0.0
    offset = torch.zeros(n_experts, dtype=torch.float64)
    best, best_offset = math.inf, offset
    for _ in range(_SETTLE_ROUNDS if spread > 0 else 0):
        rows = w + torch.outer(offset, along)
        load_router_weight(
            ffn.router_type, ffn.router.gate, rows.to(gate_weight.dtype).to(gate_weight.device)
        )
        chosen = _selections(ffn.router(inputs)).reshape(-1)
        counts = torch.bincount(chosen[chosen >= 0], minlength=n_experts).double().cpu()
        ratio = counts / counts.mean().clamp_min(1e-12)
        if float(ratio.max()) < best:
            best, best_offset = float(ratio.max()), offset.clone()
        offset = offset - _SETTLE_STEP * spread * torch.log(ratio.clamp_min(_SETTLE_FLOOR))
    return w + torch.outer(best_offset, along)


def router_load_report(
    model: MoEEUpcycledPreTrainedModel, ids: torch.Tensor, mask: torch.Tensor | None = None
) -> list[dict[str, Any]]:
    """Per MoE layer, the load on the sample ``ids`` (``mask``: its attention mask; padding is not
    counted): ``load`` the fraction of all top-k selections each expert received,
    ``max_over_mean`` the heaviest expert's load over the mean (1 is even; ``ceiling`` =
    experts / top-k is every token on the same experts), ``dead`` the experts never selected,
    ``collapsed`` whether max/mean exceeds `COLLAPSE_MAX_OVER_MEAN` or an expert is dead."""
    with torch.no_grad():
        mask = torch.ones_like(ids) if mask is None else mask
        flat_mask = mask.reshape(-1).bool()
        ffns = model.moe_ffns()
        picks: list[list[torch.Tensor]] = [[] for _ in ffns]
        handles = []
        for i, ffn in enumerate(ffns):

            def grab(_module, _args, out, i=i):
                picks[i].append(_selections(out).detach().cpu())

            handles.append(ffn.router.register_forward_hook(grab))
        try:
            _forward_base(model, ids, mask)
        finally:
            for handle in handles:
                handle.remove()
        report = []
        for i, (ffn, rows) in enumerate(zip(ffns, picks)):
            n_experts, k = ffn.router.num_experts, ffn.router.top_k
            chosen = torch.cat(rows)[flat_mask].reshape(-1)
            counts = torch.bincount(chosen[chosen >= 0], minlength=n_experts).double()
            share = counts / counts.sum().clamp_min(1)
            max_over_mean = float(share.max() * n_experts) if counts.sum() > 0 else 0.0
            dead = int((counts == 0).sum())
            report.append(
                {
                    "layer": i,
                    "load": [round(float(v), 4) for v in share],
                    "max_over_mean": max_over_mean,
                    "ceiling": n_experts / k,
                    "dead": dead,
                    "collapsed": max_over_mean > COLLAPSE_MAX_OVER_MEAN or dead > 0,
                }
            )
        return report


#: What ``moee upcycle`` writes (`moee.io.FolderOutput`): the Hugging Face model and tokenizer
#: files by name count as its own in a folder saved before output records existed.
UPCYCLED_OUTPUT = FolderOutput(
    "moee upcycle",
    owned=(
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "model-*-of-*.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "chat_template.jinja",
        "vocab.txt",
        "vocab.json",
        "merges.txt",
        "tokenizer.model",
    ),
    marker="config.json",
    last=("config.json",),
)


def save_upcycled(
    model: MoEEUpcycledPreTrainedModel,
    out: str | Path,
    *,
    tokenizer_from: str | Path | None = None,
    tokenizer=None,
    overwrite: bool = False,
    inputs: dict[str, Any] | None = None,
) -> Path:
    """Write ``model`` to the folder ``out`` (safetensors) and, when given, ``tokenizer`` or the
    tokenizer of ``tokenizer_from``.

    Everything is written into a unique hidden folder beside ``out`` first (`moee.io.StagedFolder`):
    a killed save leaves no ``out`` that looks finished. A non-empty ``out`` needs
    ``overwrite=True``, which replaces the files of the previous model there (no stale tokenizer
    stays) and keeps every other file (`moee.io.commit_folder`). An ``out`` that is, holds or lies
    inside the model's source (``model.config.upcycled_from``), ``tokenizer_from`` or one of
    ``inputs`` (name -> path) is refused, as is a file named ``out``. Files get the umask's modes.
    """
    from moee.io import StagedFolder, check_output_folder

    sources = {
        "upcycled_from": getattr(model.config, "upcycled_from", None),
        "tokenizer_from": tokenizer_from,
        **(inputs or {}),
    }
    out = check_output_folder(
        out, overwrite=overwrite, what="output folder", inputs=sources, output=UPCYCLED_OUTPUT
    )
    if tokenizer is None and tokenizer_from is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    with StagedFolder(out, UPCYCLED_OUTPUT) as staging:
        model.save_pretrained(staging, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
    return out


#: transformers ``model_type`` names accepted by :func:`upcycle`.
SUPPORTED_MODEL_TYPES = tuple(sorted(FAMILIES))


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
    path = Path(src)
    if not path.exists():
        return src
    has = path.is_dir() and any(
        (path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt")
    )
    return src if has else None


def _adapt_tokenizer(model: MoEEUpcycledPreTrainedModel, tokenizer: Any, settings: UpcycleSettings):
    """The tokenizer to save: trimmed to ``--trim-vocab``'s tokens (the model's embeddings too) and,
    for an encoder made causal, with a BOS-only template (any fast tokenizer: WordPiece for BERT,
    byte-level BPE for RoBERTa; only trimming needs a WordPiece / WordLevel vocabulary)."""
    import numpy as np

    from moee.io import iter_jsonl
    from moee.moe.vocab import causal_template, keep_for_counts, trim_vocabulary

    if settings.trim_vocab:
        from tqdm.auto import tqdm

        counts = np.zeros(len(tokenizer), dtype=np.int64)
        batch: list[str] = []

        def flush() -> None:
            for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
                counts[:] += np.bincount(ids, minlength=len(counts))[: len(counts)]
            batch.clear()

        for _, row in tqdm(iter_jsonl(settings.trim_vocab), desc="count tokens", unit=" docs"):
            batch.append(row["text"])  # every row was checked before loading
            if len(batch) >= 1000:
                flush()
        flush()
        keep = keep_for_counts(tokenizer, counts, settings.min_count)
        model, tokenizer, _ = trim_vocabulary(model, tokenizer, keep)
    if settings.causal and not family_rule(model.config.text_config.model_type).decoder:
        tokenizer = causal_template(tokenizer)
    return tokenizer


def upcycle_to_folder(
    src: str, settings: UpcycleSettings
) -> tuple[MoEEUpcycledPreTrainedModel, Path, Any, str]:
    """``moee upcycle``: the MoE model of the dense ``src`` under ``settings``, written to
    ``settings.out`` (staged, committed by rename) with the source's tokenizer, trimmed to
    ``trim_vocab``'s tokens and made BOS-only for an encoder made causal. Every input is checked
    before the dense model loads: the output folder (empty or ``overwrite``, neither an input nor
    holding or inside one), the ``trim_vocab`` and ``calibrate`` corpora (read through once), the
    tokenizer. Returns the model, the folder, the saved tokenizer (``None``: the source has none)
    and what the routers were balanced on."""
    from moee.io import check_output_folder

    if settings.out is None:
        raise ValueError("--out is required: the folder the model is written to")
    inputs = settings.inputs(src)
    check_output_folder(settings.out, overwrite=settings.overwrite, inputs=inputs, output=UPCYCLED_OUTPUT)
    if settings.trim_vocab:
        _check_corpus(settings.trim_vocab, "--trim-vocab corpus")
    if settings.calibrate:
        _check_corpus(settings.calibrate, "--calibrate corpus")
    tokenizer_from = _tokenizer_source(src)
    if tokenizer_from is None and (settings.trim_vocab or settings.calibrate):
        raise ValueError(f"--trim-vocab / --calibrate need the tokenizer of {src}, and it has none")
    tokenizer = None
    if tokenizer_from is not None:  # loaded (and checked) before the model
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    if settings.trim_vocab:
        from moee.moe.vocab import check_trimmable

        check_trimmable(tokenizer)
    calibration = mask = None
    source = settings.calibrate or settings.trim_vocab
    texts = calibration_texts(corpus=source) if source else None
    if texts:
        enc = tokenizer(texts, padding=True, truncation=True, max_length=32, return_tensors="pt")
        calibration, mask = enc["input_ids"], enc["attention_mask"]
    model = upcycle(src, settings, calibration=calibration, calibration_mask=mask, tokenizer=tokenizer)
    if tokenizer is not None and (settings.trim_vocab or settings.causal):
        tokenizer = _adapt_tokenizer(model, tokenizer, settings)
    out = save_upcycled(model, settings.out, tokenizer=tokenizer, overwrite=settings.overwrite, inputs=inputs)
    if source:
        sample = f"the first {len(texts)} texts of {source}"
    elif tokenizer is not None:
        sample = (
            "256 documents of nine kinds shipped with moee (--calibrate CORPUS.jsonl balances on your text)"
        )
    else:
        sample = "seeded random token ids (the model has no tokenizer)"
    return model, out, tokenizer, sample
