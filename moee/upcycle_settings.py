"""The settings of ``moee upcycle`` and of ``moee.moe.upcycle.upcycle``: one frozen
:class:`UpcycleSettings` field per flag (``moee.cli_options`` builds the flags from the fields'
metadata), checked once when built, so the functions it configures (``upcycle``,
``upcycle_to_folder``) trust it. Its router options are the fields of
``moee.moe.gate_registry.RouterFields``, read and typed from there.

A Python caller's keywords (``upcycle(src, n_experts=4, top_k=2)``) build the same settings with
:meth:`UpcycleSettings.from_keywords`, and its errors name those keywords; the command line's name
the flags. Standard library only at import: the command line's parser imports this module
without torch, which ``moee.moe`` imports (hence it lives beside that package, not in it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import InitVar, dataclass, field
from typing import Any

__all__ = ["MODES", "ROUTER_INITS", "UpcycleSettings", "check_layer_order", "router_options"]

MODES = ("split", "copy", "lora")
ROUTER_INITS = ("centroid", "random", "zero")
#: The Python keyword of a field where it differs from the field (the flag's) name.
KEYWORDS = {
    "experts": "n_experts",
    "router": "router_type",
    "router_option": "router_options",
    "router_balance": "balance_router",
}


class _GateNames:
    """The ``--router`` choices: the names of ``moee.moe.gate_registry.GATES``, read only when
    argparse checks a value or prints them (the registry imports torch; ``moee --help`` must not)."""

    def _names(self) -> tuple[str, ...]:
        from moee.moe.gate_registry import GATES

        return tuple(GATES)

    def __contains__(self, name: object) -> bool:
        return name in self._names()

    def __iter__(self):
        return iter(self._names())


def check_layer_order(order: Sequence[int] | None, n_layers: int | None) -> None:
    """A layer order is a non-empty list of layer indices in ``[0, n_layers)`` (checked on the
    config, before the weights load; ``n_layers=None``: before the config is read)."""
    if order is None:
        return
    bad = not isinstance(order, (list, tuple)) or not order
    bad = bad or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in order)
    if not bad and n_layers is not None:
        bad = any(i >= n_layers for i in order)
    if bad:
        where = f"[0, {n_layers})" if n_layers is not None else "[0, number of layers)"
        raise ValueError(f"layer order must be a non-empty list of layer indices in {where}, got {order!r}")


def _parse_layer_order(text: str) -> tuple[int, ...]:
    """``--layer-order I,J,...``."""
    if not text.strip():
        raise ValueError(
            "--layer-order is empty: give the dense layers to stack, e.g. --layer-order 0,1,2,3,2,3, "
            "or leave the flag out to keep the dense model's layers as they are"
        )
    try:
        order = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--layer-order must be comma-separated integers, got {text!r}") from None
    if any(i < 0 for i in order):
        raise ValueError(f"--layer-order takes layer indices >= 0, got {text!r}")
    return order


def router_options(pairs: Sequence[str]) -> dict[str, Any]:
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


def _number(help_text: str, default: float) -> Any:
    return field(default=default, metadata={"help": help_text, "type": float})


@dataclass(frozen=True, kw_only=True)
class UpcycleSettings:
    """How a dense checkpoint becomes an MoE model (``moee upcycle`` flags of the same names;
    ``moee.moe.upcycle.upcycle`` documents each). ``router_config`` (not a flag) is what the
    router flags give the model's config: ``router_type``, ``router_bias_gamma`` and the
    ``--router-option`` fields of ``RouterFields``, typed by their declarations."""

    out: str | None = field(default=None, metadata={"help": "output directory", "required": True})
    experts: int = field(metadata={"help": "routed experts per layer", "type": int})
    top_k: int = field(metadata={"help": "experts selected per token", "type": int})
    mode: str = field(
        default="split",
        metadata={
            "help": "split: experts partition each FFN's neurons; copy: every expert a copy of the FFN; "
            "lora: the FFN shared, each expert a low-rank adapter of its down projection",
            "choices": MODES,
        },
    )
    lora_rank: int = field(
        default=8, metadata={"help": "lora: the rank of each expert's adapter", "type": int}
    )
    shared_neurons: int = field(
        default=0,
        metadata={
            "help": "split: keep N neurons always on as a shared expert",
            "type": int,
            "metavar": "N",
        },
    )
    shared_select: str = field(
        default="norm",
        metadata={
            "help": "split: which neurons are shared: largest weight norm, or most central direction",
            "choices": ("norm", "central"),
        },
    )
    shared_copy: bool = field(default=False, metadata={"help": "copy: add an always-on copy of the FFN"})
    router_init: str | None = field(
        default=None,
        metadata={
            "help": "router start: centroids of the FFN's neuron clusters (split, lora), random "
            "normal, or zero",
            "choices": ROUTER_INITS,
            "default_text": "centroid for split and lora, random for copy",
        },
    )
    router_std: float = _number("std of a random router", 0.02)
    seed: int = field(
        default=0,
        metadata={
            "help": "every random draw: k-means starts, random routers, weights the checkpoint lacks "
            "(an encoder's new LM head)",
            "type": int,
        },
    )
    calibrate: str | None = field(
        default=None,
        metadata={
            "help": "texts ({'text': ...} per line; the first 256 are read) the routers are balanced "
            "on (the first three quarters) and their start load measured on (the last quarter); text "
            "like the model's training text balances best",
            "metavar": "CORPUS.jsonl",
            "default_text": "the --trim-vocab corpus, else the documents of nine kinds shipped with "
            "minilm-moe (moee/assets/default-model/heldout.jsonl)",
        },
    )
    router_balance: bool = field(
        default=True,
        metadata={
            "help": "keep the raw router start (by default every router has the shared component of "
            "its layer's inputs removed and per-expert offsets settled, so the experts start evenly "
            "loaded)"
        },
    )
    dtype: str | None = field(
        default=None,
        metadata={"help": "load and save in this dtype", "choices": ("float32", "bfloat16", "float16")},
    )
    causal: bool = field(
        default=False,
        metadata={
            "help": "encoders (BERT, RoBERTa): make a causal LM (causal attention, LM head tied to the "
            "embeddings, tokenizer adds only a leading CLS as BOS)"
        },
    )
    layer_order: tuple[int, ...] | None = field(
        default=None,
        metadata={
            "help": "depth up-scaling first: the new layer list as old layer indices, e.g. 0,1,2,3,2,3,4,5",
            "metavar": "I,J,...",
        },
    )
    router: str = field(
        default="loss_free",
        metadata={
            "help": "the gate: %(choices)s (moee.moe.gate_registry.GATES, as in moee train's "
            "model.router_type); loss_free: top-k softmax with a selection bias that keeps the load "
            "balanced while the model trains; untrained it computes what noisy_top_k without noise, "
            "the deterministic top-k, does",
            "choices": _GateNames(),
            # a metavar keeps argparse from listing the choices (importing torch) at start-up
            "metavar": "GATE",
        },
    )
    router_bias_gamma: float = _number("loss-free bias step", 1e-3)
    router_option: tuple[str, ...] | Mapping[str, Any] = field(
        default=(),
        metadata={
            "help": "another router_* field of the gate (repeatable), VALUE parsed by the field's type: "
            "true/false for a bool, an integer, a finite number, null where the field may be unset; "
            "e.g. router_n_groups=4 for hierarchical (moee/moe/README_TRAINING.md lists them)",
            "action": "append",
            "metavar": "KEY=VALUE",
        },
    )
    trim_vocab: str | None = field(
        default=None,
        metadata={
            "help": "keep only tokens seen in this JSONL corpus ({'text': ...} per line), plus special "
            "and single-character tokens (WordPiece/WordLevel tokenizers)",
            "metavar": "CORPUS.jsonl",
        },
    )
    min_count: int = field(
        default=1, metadata={"help": "--trim-vocab: times a token must occur", "type": int}
    )
    overwrite: bool = field(
        default=False,
        metadata={
            "help": "write into a non-empty --out folder: the previous model's files there are "
            "replaced, a user's other files stay"
        },
    )
    #: the router's config fields (``router_type``, ``router_bias_gamma``, the options), checked
    router_config: dict[str, Any] = field(init=False, repr=False, compare=False)
    #: name errors by the Python keywords (``from_keywords``) instead of the flags
    keywords: InitVar[bool] = False

    @classmethod
    def from_keywords(
        cls,
        *,
        n_experts: int,
        top_k: int,
        router_type: str = "loss_free",
        router_options: Mapping[str, Any] | None = None,
        balance_router: bool = True,
        dtype: Any = None,
        layer_order: Sequence[int] | None = None,
        **rest: Any,
    ) -> UpcycleSettings:
        """The settings of ``upcycle``'s keywords (the fields, with ``n_experts``, ``router_type``,
        ``router_options`` (a mapping) and ``balance_router`` for ``experts``, ``router``,
        ``router_option`` and ``router_balance``; ``dtype`` may be a ``torch.dtype``)."""
        if dtype is not None and not isinstance(dtype, str):
            dtype = str(dtype).removeprefix("torch.")
        return cls(
            experts=n_experts,
            top_k=top_k,
            router=router_type,
            router_option=dict(router_options or {}),
            router_balance=balance_router,
            dtype=dtype,
            layer_order=layer_order,
            keywords=True,
            **rest,
        )

    def name(self, field_name: str) -> str:
        """How errors name a field: its flag, or (``from_keywords``) its Python keyword."""
        if self._keywords:
            return KEYWORDS.get(field_name, field_name)
        return "--" + field_name.replace("_", "-")

    def __post_init__(self, keywords: bool) -> None:
        from moee.moe.gate_registry import check_router_options, gate_spec, router_option_types

        object.__setattr__(self, "_keywords", keywords)
        name = self.name
        # the router: its name, its options (by their declared types), the bias step the options win over
        gate_spec(self.router)  # an unknown name fails here, before the dense model loads
        if isinstance(self.router_option, Mapping):  # Python values
            known = list(router_option_types())
            unknown = sorted(k for k in self.router_option if k not in known)
            if unknown:
                raise ValueError(f"unknown router option(s) {', '.join(unknown)}; known: {', '.join(known)}")
            options = dict(self.router_option)
            check_router_options(options)  # by each field's type: no "maybe" bool, no NaN
        else:  # the flag's KEY=VALUE texts
            object.__setattr__(self, "router_option", tuple(self.router_option))
            options = router_options(self.router_option)
        config = {"router_type": self.router, "router_bias_gamma": self.router_bias_gamma, **options}
        object.__setattr__(self, "router_config", config)
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.router_init is not None and self.router_init not in ROUTER_INITS:
            raise ValueError(f"router_init must be one of {ROUTER_INITS}, got {self.router_init!r}")
        if self.mode == "copy" and self.router_init == "centroid":
            raise ValueError(
                "router_init='centroid' needs mode='split': copied experts are identical, there is "
                "nothing to cluster"
            )
        if self.mode != "split" and self.shared_neurons:
            raise ValueError(
                "shared_neurons is for mode='split'; use shared_copy=True for a copied shared expert "
                "(mode='lora' always keeps the whole FFN shared)"
            )
        if self.mode != "copy" and self.shared_copy:
            raise ValueError("shared_copy is for mode='copy'; use shared_neurons=N for split mode")
        lora_rank = self.lora_rank
        if self.mode == "lora" and (
            isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank < 1
        ):
            raise ValueError(f"{name('lora_rank')} must be a positive int for mode='lora', got {lora_rank!r}")
        n = self.experts
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name('experts')} must be a positive int, got {n!r}")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
            raise ValueError(f"{name('top_k')} must be an int in [1, {name('experts')}={n}], got {k!r}")
        for key, value in (
            ("router_std", self.router_std),
            ("router_bias_gamma", config["router_bias_gamma"]),
        ):
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value < 0
            ):
                raise ValueError(f"{name(key)} must be a finite number >= 0, got {value!r}")
        # a negative count is refused here from the command line; a Python caller's with the width
        # it must lie below, once the dense model's is known (`upcycle`)
        if not keywords and self.shared_neurons < 0:
            raise ValueError(f"--shared-neurons must be >= 0, got {self.shared_neurons}")
        if isinstance(self.layer_order, str):
            object.__setattr__(self, "layer_order", _parse_layer_order(self.layer_order))
        check_layer_order(self.layer_order, None)
        if isinstance(self.layer_order, list):
            object.__setattr__(self, "layer_order", tuple(self.layer_order))
        if not isinstance(self.router_balance, bool):  # None once meant "the default"; now it would mean off
            raise ValueError(f"{name('router_balance')} must be True or False, got {self.router_balance!r}")
        if isinstance(self.min_count, bool) or not isinstance(self.min_count, int) or self.min_count < 1:
            raise ValueError(f"{name('min_count')} must be >= 1, got {self.min_count}")
        if self.min_count != 1 and not self.trim_vocab:
            raise ValueError(f"{name('min_count')} applies to {name('trim_vocab')} only")

    def inputs(self, src: Any) -> dict[str, Any]:
        """What the command reads, by flag: ``--out`` may be none of them, hold none, lie inside none."""
        return {"SRC": src, "--calibrate": self.calibrate, "--trim-vocab": self.trim_vocab}
