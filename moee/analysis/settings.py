"""The settings of the analysis commands: one frozen dataclass per command (``moee routes``:
:class:`RoutesSettings`, ``moee report``: :class:`ReportSettings`, ``moee ablate``:
:class:`AblateSettings`), one field per flag (``moee.cli_options`` builds the flags from the
fields' metadata), each checked once when it is built, so the library functions they configure
(``moee.analysis.routing_export.export_routes``, ``moee.analysis.specialization.run.run_report``,
``moee.analysis.ablate.run_ablation``) trust them. Error messages name the flag. Standard library
only at import: the command line's parser imports this module without torch.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from dataclasses import field as _field  # a settings field is named `field` (--field)
from typing import Any

from moee.embed.config import EmbeddingConfig
from moee.loading import LoadOptions
from moee.models.bundled import model_field

__all__ = ["AblateSettings", "ReportSettings", "RoutesSettings", "flag_of"]

CORPUS_HELP = ".txt (one text a line), .jsonl or .parquet file"


def flag_of(name: str) -> str:
    """The flag of a settings field, for messages that name the fix."""
    return "--" + name.replace("_", "-")


# fields every analysis command shares, declared once
_model = model_field


def _load() -> Any:
    return _field(default_factory=LoadOptions, metadata={"embed": LoadOptions})


def _corpus() -> Any:
    return _field(metadata={"help": CORPUS_HELP})


def _text_field() -> Any:
    return _field(
        default=None,
        metadata={"help": "text field of a .jsonl/.parquet corpus", "default_text": "text"},
    )


def _int(default: int | None, help_text: str, **extra: Any) -> Any:
    return _field(default=default, metadata={"help": help_text, "type": int, **extra})


def _check_ints(settings: Any, names: tuple[str, ...], message: str, least: int = 1) -> None:
    """Each of ``names`` unset or an int >= ``least``: ``message`` formats ``flag`` and ``value``."""
    for name in names:
        value = getattr(settings, name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(message.format(flag=flag_of(name), value=value, least=least))


def _freeze(settings: Any, *names: str) -> None:
    """A list value (``nargs="+"``) kept as a tuple: the settings are immutable."""
    for name in names:
        value = getattr(settings, name)
        if isinstance(value, list):
            object.__setattr__(settings, name, tuple(value))


# ---------------------------------------------------------------------------- moee routes
#: Configuration fields without a flag in ``moee routes``: token routes are per token, before any
#: pooling or combination, under one prompt.
ROUTES_NOT_FLAGS = {
    "method": "token routes come before any method combines HS and RW",
    "pooling": "token routes are per token, not pooled",
    "alpha": "token routes come before any method combines HS and RW",
    "normalize": "token routes are not pooled vectors",
    "recipe": "token routes run the plain forward",
    "hs_layer": "token routes hold no hidden states",
    "rw_layers": "every MoE layer's routes are written",
    "reference": "token routes are not standardised",
}


@dataclass(frozen=True, kw_only=True)
class RoutesSettings:
    """What ``moee routes`` exports (``moee.analysis.routing_export.export_routes``). ``config``
    is the resolved embedding configuration: ``--prompt`` / ``--score`` given, else the model's
    saved configuration, else the library default."""

    model: str | None = _model()
    load: LoadOptions = _load()
    config: EmbeddingConfig = _field(
        default_factory=EmbeddingConfig, metadata={"embed": EmbeddingConfig, "exclude": ROUTES_NOT_FLAGS}
    )
    corpus: str = _corpus()
    field: str | None = _text_field()
    max_texts: int | None = _int(None, "use only the first N texts")
    dense: bool = _field(default=False, metadata={"help": "also the dense scores over all experts"})
    batch_size: int = _int(16, "texts per forward")
    out: str = _field(metadata={"help": "output .parquet file (its sidecar: OUT.json)"})
    overwrite: bool = _field(default=False, metadata={"help": "replace an existing --out"})

    def __post_init__(self) -> None:
        _check_ints(self, ("max_texts",), "{flag} must be a positive integer, got {value}")
        _check_ints(self, ("batch_size",), "{flag} must be >= 1, got {value}")
        if self.config.is_ensemble:
            raise ValueError(
                f"moee routes runs one prompt; the configuration's prompt is the ensemble "
                f"{self.config.prompt_label!r}: give one --prompt"
            )


# ---------------------------------------------------------------------------- moee report
@dataclass(frozen=True, kw_only=True)
class ReportSettings:
    """What ``moee report`` builds (``moee.analysis.specialization.run.run_report``)."""

    model: str | None = _model()
    load: LoadOptions = _load()
    corpus: str = _corpus()
    field: str | None = _text_field()
    domain_field: str | None = _field(
        default=None, metadata={"help": "field holding each text's domain label"}
    )
    top_k: int | None = _int(None, "experts counted per token", default_text="the model's")
    max_texts: int | None = _int(None, "use only the first N texts")
    permutations: int = _int(10, "permutation draws per baseline")
    seed: int = _int(0, "seed of the permutation baselines")
    batch_size: int = _int(16, "texts per forward")
    checkpoints: tuple[str, ...] | None = _field(
        default=None,
        metadata={
            "help": "checkpoints of one model (paths, Hub ids or name@revision) for router saturation",
            "nargs": "+",
            "metavar": "CKPT",
        },
    )
    compare: str | None = _field(
        default=None, metadata={"help": "a second model or checkpoint", "metavar": "MODEL_B"}
    )
    overlap_tokens: int = _int(
        65536, "tokens (first texts) on which saturation / comparison overlaps are measured"
    )
    ablation: str | None = _field(
        default=None,
        metadata={
            "help": "a `moee ablate` result of this model (its --out folder or importance.json) for "
            "the causal expert-importance section",
            "metavar": "DIR_OR_JSON",
        },
    )
    router_swap: str | None = _field(
        default=None,
        metadata={
            "help": "a `moee ablate --swap-from` result of this model (its --out folder or swap.json) "
            "for the router-swap section",
            "metavar": "DIR_OR_JSON",
        },
    )
    steering: tuple[str, ...] | None = _field(
        default=None,
        metadata={
            "help": "`moee ablate --steer` results of this model (--out folders or steering.json), one "
            "case each, for the steering section",
            "nargs": "+",
            "metavar": "DIR_OR_JSON",
        },
    )
    token_view_texts: int = _int(8, "texts in the token view")
    token_view_tokens: int = _int(256, "tokens in the token view in all")
    out: str = _field(metadata={"help": "output folder (report.json and report.html)"})
    overwrite: bool = _field(default=False, metadata={"help": "replace the report already in --out"})

    def __post_init__(self) -> None:
        _freeze(self, "checkpoints", "steering")
        _check_ints(self, ("max_texts", "overlap_tokens"), "{flag} must be >= 1, got {value}")
        # the token view may be empty; its message has always read ">= 1"
        _check_ints(self, ("token_view_texts", "token_view_tokens"), "{flag} must be >= 1, got {value}", 0)
        _check_ints(self, ("top_k", "permutations", "batch_size"), "{flag} must be >= {least}, got {value}")
        if self.checkpoints is not None and len(self.checkpoints) < 2:
            raise ValueError("--checkpoints needs at least two checkpoints (the last one is the final)")

    def inputs(self) -> dict[str, Any]:
        """What the report reads, by flag: ``--out`` may be none of them, hold none, lie inside none."""
        return {
            "--model": self.model,
            "--corpus": self.corpus,
            "--checkpoints": list(self.checkpoints) if self.checkpoints is not None else None,
            "--compare": self.compare,
            "--ablation": self.ablation,
            "--router-swap": self.router_swap,
            "--steering": list(self.steering) if self.steering is not None else None,
        }


# ---------------------------------------------------------------------------- moee ablate
class Expert(tuple):
    """``(layer, expert)`` parsed from ``L:E``; prints as ``L:E`` so the recorded command re-runs."""

    def __str__(self) -> str:
        return f"{self[0]}:{self[1]}"


class Steer(tuple):
    """``((layer, expert), bias)`` parsed from ``L:E=BIAS``; prints as ``L:E=BIAS``."""

    def __str__(self) -> str:
        return f"{self[0]}={self[1]!r}"


def parse_expert(text: str) -> Expert:
    """``--experts L:E``."""
    try:
        layer, expert = text.split(":")
        return Expert((int(layer), int(expert)))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected LAYER:EXPERT (MoE-layer position), got {text!r}"
        ) from None


def parse_steer(text: str) -> Steer:
    """``--steer L:E=BIAS``; a non-finite bias is refused (a NaN would poison every logit of the layer)."""
    try:
        pair, value = text.split("=")
        steer = Steer((parse_expert(pair), float(value)))
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"expected LAYER:EXPERT=BIAS, got {text!r}") from None
    if not math.isfinite(steer[1]):
        raise argparse.ArgumentTypeError(f"BIAS must be a finite number, got {text!r}")
    return steer


@dataclass(frozen=True, kw_only=True)
class AblateSettings:
    """What ``moee ablate`` measures (``moee.analysis.ablate.run_ablation``): expert importance by
    default, the router swap with ``swap_from``, the steering effect with ``steer``."""

    model: str | None = _model()
    load: LoadOptions = _load()
    corpus: str = _corpus()
    field: str | None = _text_field()
    domain_field: str | None = _field(
        default=None, metadata={"help": "field of a .jsonl corpus holding each text's domain"}
    )
    layers: tuple[int, ...] | None = _field(
        default=None,
        metadata={
            "help": "MoE-layer positions to ablate",
            "type": int,
            "nargs": "+",
            "default_text": "all",
        },
    )
    experts: tuple[Expert, ...] | None = _field(
        default=None,
        metadata={"help": "only these experts", "type": parse_expert, "nargs": "+", "metavar": "L:E"},
    )
    max_tokens: int = _int(4096, "tokens of the corpus used")
    per_domain_tokens: int | None = _int(None, "at most N tokens of each domain", default_text="no cap")
    seq_len: int = _int(128, "tokens per chunk")
    batch_size: int = _int(16, "chunks per forward")
    mode: str = _field(
        default="reselect",
        metadata={"help": "how an expert is disabled", "choices": ("reselect", "zero")},
    )
    renormalize: bool = _field(
        default=False, metadata={"help": "--mode zero: the other weights keep the total"}
    )
    no_null: bool = _field(default=False, metadata={"help": "skip the null (half the passes or fewer)"})
    seed: int = _int(0, "seed of the null's draws")
    null_draws: int | None = _int(
        None,
        "--swap-from / --steer: null draws (permutations / expert sets) per row",
        default_text="expert_importance.NULL_DRAWS, 3",
    )
    super_ratio: float = _field(
        default=10.0,
        metadata={"help": "super-expert threshold over the median", "type": float},
    )
    swap_from: str | None = _field(
        default=None,
        metadata={"help": "router swap with this checkpoint instead", "metavar": "CKPT"},
    )
    steer: tuple[Steer, ...] | None = _field(
        default=None,
        metadata={
            "help": "steering effect instead",
            "type": parse_steer,
            "nargs": "+",
            "metavar": "L:E=BIAS",
        },
    )
    steer_texts: int = _int(64, "texts embedded for --steer")
    out: str = _field(metadata={"help": "output folder"})
    overwrite: bool = _field(default=False, metadata={"help": "replace results already in --out"})

    def __post_init__(self) -> None:
        _freeze(self, "layers", "experts", "steer")
        _check_ints(
            self,
            ("max_tokens", "seq_len", "batch_size", "steer_texts", "per_domain_tokens", "null_draws"),
            "{flag} must be a positive integer, got {value}",
        )
        if self.swap_from and self.steer:
            raise ValueError("--swap-from and --steer are two analyses: run them one at a time")
        self._check_selection()

    def _check_selection(self) -> None:
        """Each of ``--layers``, ``--experts`` and ``--steer`` names a layer or expert at most once
        (a repeat is refused rather than merged: it would be measured and written twice, and a
        second ``--steer`` bias for the same expert would silently replace the first; a repeat is
        more often a typo for another expert), and every ``--experts`` pair lies in ``--layers``
        when both are given (else the selection is not what was asked, or empty)."""
        for flag, items in (
            ("--layers", self.layers),
            ("--experts", self.experts),
            ("--steer", [pair for pair, _ in self.steer or []]),
        ):
            seen: set = set()
            for item in items or []:
                if item in seen:
                    shown = item if flag == "--layers" else f"{item[0]}:{item[1]}"
                    raise ValueError(f"{flag} names {shown} twice; give each once")
                seen.add(item)
        if self.layers is not None and self.experts is not None:
            outside = [f"{layer}:{expert}" for layer, expert in self.experts if layer not in self.layers]
            if outside:
                raise ValueError(
                    f"--experts {' '.join(outside)} lie outside --layers {' '.join(map(str, self.layers))}: "
                    "drop them, add their layers, or leave --layers out (--experts alone selects them)"
                )

    def check_in_model(self, n_experts: list[int]) -> None:
        """Every layer and expert that ``--layers``, ``--experts`` and ``--steer`` name exists in
        the model (``n_experts``: per MoE layer), checked once it loads, before any forward pass."""
        pairs = [("--experts", p) for p in self.experts or []] + [("--steer", p) for p, _ in self.steer or []]
        layers = [("--layers", layer) for layer in self.layers or []] + [(f, p[0]) for f, p in pairs]
        for flag, layer in layers:
            if not 0 <= layer < len(n_experts):
                raise ValueError(
                    f"{flag}: MoE layer {layer} out of range (the model has {len(n_experts)} MoE layers)"
                )
        for flag, (layer, expert) in pairs:
            if not 0 <= expert < n_experts[layer]:
                raise ValueError(
                    f"{flag}: expert {expert} out of range in MoE layer {layer} ({n_experts[layer]} experts)"
                )
