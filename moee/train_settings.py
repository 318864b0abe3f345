"""The settings of ``moee train``: the training configuration (:class:`TrainingConfig`, one frozen
section per section of the JSON file) and the command's own flags (:class:`TrainSettings`).

:meth:`TrainingConfig.from_dict` reads every config file and every config a checkpoint saved:
an unknown section or key is refused by name, a key left out takes its default, and every value
is checked once, when its section is built, the error naming the key
(``optim.lr must be > 0, got 0``). :meth:`TrainingConfig.to_dict` gives back the dict the trainer
saves into each checkpoint (every key, in the documented order, the values as given), so a saved
config reads back to the same config and is written out byte for byte as before. The trainer
(``moee.moe.trainer``) reads attributes of it; the format is documented in
moee/moe/README_TRAINING.md. Standard library only at import: the command line's parser imports
this module without torch, which ``moee.moe`` imports (hence it lives beside that package).
"""

from __future__ import annotations

import copy
import json
import math
import os
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar

__all__ = [
    "TRAINABLE",
    "CheckpointSection",
    "DataSection",
    "EvalSection",
    "InitSection",
    "OptimSection",
    "ScheduleSection",
    "TrainSettings",
    "TrainingConfig",
]

#: what `optim.trainable` may name: every parameter, or only the routers and the routed experts
#: (what an upcycled ``lora`` model's delta holds; the dense model stays frozen)
TRAINABLE = ("all", "routed")

#: the top-level key a config file may add for people (ignored, not saved)
COMMENT_KEY = "_comment"


# ---------------------------------------------------------------------------- value checks
def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


def _check_int(name: str, value: Any, least: int, *, optional: bool = False) -> None:
    """``value`` an int >= ``least`` (``optional``: or None)."""
    if optional and value is None:
        return
    if not _is_int(value) or value < least:
        what = "a positive integer" if least == 1 else f"an integer >= {least}"
        raise ValueError(f"{name} must be {what}{' or null' if optional else ''}, got {value!r}")


def _check_number(name: str, value: Any, rule: str, holds: bool, *, optional: bool = False) -> None:
    """``value`` a number (not NaN) for which ``holds`` (``rule`` says how; ``optional``: or None)."""
    if optional and value is None:
        return
    if not _is_number(value) or not holds:
        raise ValueError(f"{name} must be {rule}{' or null' if optional else ''}, got {value!r}")


def _path(section: Any, name: str, *, optional: bool) -> None:
    """A path value: a string (an ``os.PathLike`` is kept as its string, so the config saves as
    JSON); ``optional``: or None. An empty string reads as unset where a path is optional."""
    value = getattr(section, name)
    if optional and value is None:
        return
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
        object.__setattr__(section, name, value)
    keys = {f.name: _key(f) for f in fields(section)}
    key = f"{section.SECTION}.{keys[name]}"
    if not isinstance(value, str):
        raise ValueError(f"{key} must be a path (a string){' or null' if optional else ''}, got {value!r}")


def _key(f: Any) -> str:
    """The JSON key of a section field (``init.from``: a Python keyword, hence the field ``from_``)."""
    return f.metadata.get("key", f.name)


def _plain(value: Any) -> Any:
    """A value as JSON holds it: tuples as lists, mappings as dicts (deep copies)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return copy.deepcopy(value)


# ---------------------------------------------------------------------------- sections
@dataclass(frozen=True, kw_only=True)
class _Section:
    """A section of the config: one field per key, the key's default as the field's."""

    SECTION: ClassVar[str] = ""

    @classmethod
    def keys(cls) -> list[str]:
        return [_key(f) for f in fields(cls)]

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """The section's keys with their defaults (without checking them: ``data.train`` is None)."""
        return {_key(f): _plain(f.default) for f in fields(cls)}

    @classmethod
    def from_dict(cls, raw: Any) -> Any:
        """The section of a config's ``raw`` object; an unknown key is refused by name."""
        if not isinstance(raw, Mapping):
            raise ValueError(f"section {cls.SECTION!r} must be an object")
        unknown = sorted(set(raw) - set(cls.keys()), key=str)
        if unknown:
            raise ValueError(f"unknown key(s) {unknown} in {cls.SECTION!r}; expected {sorted(cls.keys())}")
        names = {_key(f): f.name for f in fields(cls)}
        return cls(**{names[k]: v for k, v in raw.items()})

    def to_dict(self) -> dict[str, Any]:
        return {_key(f): _plain(getattr(self, f.name)) for f in fields(self)}


@dataclass(frozen=True, kw_only=True)
class InitSection(_Section):
    """``init``: continued pretraining from a saved model instead of a fresh ``model``."""

    SECTION: ClassVar[str] = "init"
    from_: str | None = field(default=None, metadata={"key": "from"})

    def __post_init__(self) -> None:
        _path(self, "from_", optional=True)


@dataclass(frozen=True, kw_only=True)
class DataSection(_Section):
    """``data``: the corpora (JSONL), the tokenizer, the window length and the token cache."""

    SECTION: ClassVar[str] = "data"
    train: str | None = None
    heldout: str | None = None
    tokenizer: str | None = None
    seq_len: int = 256
    cache_dir: str = "build/tokens"

    def __post_init__(self) -> None:
        for name in ("train", "tokenizer"):
            if not getattr(self, name):
                raise ValueError(f"data.{name} is required")
            _path(self, name, optional=False)
        _path(self, "heldout", optional=True)
        _check_int("data.seq_len", self.seq_len, 1)
        _path(self, "cache_dir", optional=False)


@dataclass(frozen=True, kw_only=True)
class OptimSection(_Section):
    """``optim``: AdamW, gradient clipping, the batch, the router's lr and what trains."""

    SECTION: ClassVar[str] = "optim"
    lr: float = 3e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    batch_size: int = 16
    router_lr_scale: float = 1.0
    trainable: str = "all"

    def __post_init__(self) -> None:
        _check_number("optim.lr", self.lr, "> 0", _is_number(self.lr) and self.lr > 0)
        betas = self.betas
        if not (
            isinstance(betas, (list, tuple))
            and len(betas) == 2
            and all(_is_number(b) and 0 <= b < 1 for b in betas)
        ):
            raise ValueError(f"optim.betas must be two numbers in [0, 1), got {betas!r}")
        object.__setattr__(self, "betas", tuple(betas))
        for name in ("eps", "weight_decay", "router_lr_scale"):
            value = getattr(self, name)
            _check_number(f"optim.{name}", value, ">= 0", _is_number(value) and value >= 0)
        clip = self.grad_clip
        _check_number(
            "optim.grad_clip", clip, "> 0 (the largest gradient norm)", _is_number(clip) and clip > 0
        )
        _check_int("optim.batch_size", self.batch_size, 1)
        if self.trainable not in TRAINABLE:
            raise ValueError(f"optim.trainable must be one of {TRAINABLE}, got {self.trainable!r}")


@dataclass(frozen=True, kw_only=True)
class ScheduleSection(_Section):
    """``schedule``: the steps, the warmup and cosine decay, an optional wall-clock budget."""

    SECTION: ClassVar[str] = "schedule"
    max_steps: int = 1000
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    time_budget_minutes: float | None = None

    def __post_init__(self) -> None:
        _check_int("schedule.max_steps", self.max_steps, 1)
        _check_int("schedule.warmup_steps", self.warmup_steps, 0)
        ratio = self.min_lr_ratio
        _check_number("schedule.min_lr_ratio", ratio, "in [0, 1]", _is_number(ratio) and 0 <= ratio <= 1)
        budget = self.time_budget_minutes
        ok = _is_number(budget) and 0 <= budget < math.inf
        _check_number("schedule.time_budget_minutes", budget, "a finite number >= 0", ok, optional=True)


@dataclass(frozen=True, kw_only=True)
class EvalSection(_Section):
    """``eval``: the held-out evaluation's period, windows (0 or null: all) and batch size."""

    SECTION: ClassVar[str] = "eval"
    every: int = 100
    max_windows: int | None = 256
    batch_size: int = 16

    def __post_init__(self) -> None:
        _check_int("eval.every", self.every, 1)
        _check_int("eval.max_windows", self.max_windows, 0, optional=True)
        _check_int("eval.batch_size", self.batch_size, 1)


@dataclass(frozen=True, kw_only=True)
class CheckpointSection(_Section):
    """``checkpoint``: the run folder, the checkpoint period and how many are kept (0 or null: all)."""

    SECTION: ClassVar[str] = "checkpoint"
    dir: str = "build/train"
    every: int = 100
    keep: int | None = 2

    def __post_init__(self) -> None:
        _path(self, "dir", optional=False)
        _check_int("checkpoint.every", self.every, 1)
        _check_int("checkpoint.keep", self.keep, 0, optional=True)


def _section(cls: type[_Section]) -> Any:
    return field(default_factory=cls, metadata={"section": cls})


def _check_model(model: Mapping[str, Any]) -> None:
    """Reject unknown `model` keys (MoEEConfig would store a misspelt router key and ignore it)
    and check the values, router settings included, before any data is tokenized."""
    import dataclasses

    from moee.moe.lm import MoEEConfig

    known = {f.name for f in dataclasses.fields(MoEEConfig)} | set(MoEEConfig.attribute_map)
    unknown = sorted(set(model) - known)
    if unknown:
        raise ValueError(
            f"unknown key(s) {unknown} in 'model'; expected MoEEConfig fields "
            "(router keys: moee/moe/README_TRAINING.md)"
        )
    try:
        MoEEConfig(**model)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"model: {exc}") from exc


# ---------------------------------------------------------------------------- the config
@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """A training run's configuration (moee/moe/README_TRAINING.md), checked once when built."""

    seed: int = 0
    threads: int | None = None
    #: ``moee.moe.lm.MoEEConfig`` keyword arguments (read-only; empty with ``init.from``)
    model: Mapping[str, Any] = field(default_factory=dict)
    init: InitSection = _section(InitSection)
    data: DataSection = field(metadata={"section": DataSection})
    optim: OptimSection = _section(OptimSection)
    schedule: ScheduleSection = _section(ScheduleSection)
    eval: EvalSection = _section(EvalSection)
    checkpoint: CheckpointSection = _section(CheckpointSection)
    stop_after_minutes: float | None = None

    def __post_init__(self) -> None:
        _check_int("seed", self.seed, 0)
        _check_int("threads", self.threads, 0, optional=True)  # 0 or null: torch's default
        stop = self.stop_after_minutes
        ok = _is_number(stop) and 0 <= stop < math.inf
        _check_number("stop_after_minutes", stop, "a finite number >= 0", ok, optional=True)
        for f in fields(self):
            cls = f.metadata.get("section")
            if cls is not None and not isinstance(getattr(self, f.name), cls):
                raise ValueError(f"{f.name} must be a {cls.__name__}, got {getattr(self, f.name)!r}")
        if not isinstance(self.model, Mapping):
            raise ValueError("section 'model' must be an object")
        object.__setattr__(self, "model", MappingProxyType(copy.deepcopy(dict(self.model))))
        if self.init.from_ is not None:
            if self.model:
                raise ValueError(
                    f"init.from {self.init.from_!r} brings its own architecture; "
                    f"leave 'model' empty (got {sorted(self.model)})"
                )
        else:
            _check_model(self.model)
        max_pos = self.model.get("max_position_embeddings")
        if max_pos is not None and max_pos < self.data.seq_len:
            raise ValueError(f"model.max_position_embeddings {max_pos} < data.seq_len {self.data.seq_len}")

    def __reduce__(self) -> tuple:
        """Copied and pickled as its dict (the read-only ``model`` mapping itself cannot be)."""
        return (type(self).from_dict, (self.to_dict(),))

    # ------------------------------------------------------------------ reading and writing
    @classmethod
    def keys(cls) -> list[str]:
        """The top-level keys, in the order :meth:`to_dict` writes them."""
        return [f.name for f in fields(cls)]

    @classmethod
    def default_dict(cls) -> dict[str, Any]:
        """Every key with its default, in :meth:`to_dict`'s shape (``data.train`` and
        ``data.tokenizer`` None: they have no default)."""
        out: dict[str, Any] = {}
        for f in fields(cls):
            section = f.metadata.get("section")
            if section is not None:
                out[f.name] = section.defaults()
            else:
                out[f.name] = f.default_factory() if f.default is MISSING else _plain(f.default)
        return out

    @classmethod
    def from_dict(cls, raw: Any, origin: str = "config") -> TrainingConfig:
        """The config of a JSON object (a config file's, or one a checkpoint saved): keys left out
        take their defaults; an unknown section or key, or a bad value, is a ValueError naming
        ``origin`` (the file) and the key."""
        if not isinstance(raw, Mapping):
            raise ValueError(f"{origin}: the top level must be a JSON object")
        unknown = set(raw) - set(cls.keys()) - {COMMENT_KEY}
        if unknown:
            raise ValueError(
                f"{origin}: unknown section(s) {sorted(unknown, key=str)}; expected {sorted(cls.keys())}"
            )
        values: dict[str, Any] = {}
        try:
            for f in fields(cls):
                section = f.metadata.get("section")
                if section is not None:
                    values[f.name] = section.from_dict(raw.get(f.name, {}))
                elif f.name in raw:
                    values[f.name] = raw[f.name]
            return cls(**values)
        except ValueError as exc:
            raise ValueError(f"{origin}: {exc}") from exc

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> TrainingConfig:
        """The config of a JSON file (its errors name the file)."""
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"training config {path} not found")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"training config {path} is not valid JSON: {exc}") from exc
        return cls.from_dict(raw, origin=str(path))

    @classmethod
    def load(cls, source: TrainingConfig | Mapping[str, Any] | str | os.PathLike) -> TrainingConfig:
        """A config given as itself, as a dict (:meth:`from_dict`) or as a JSON file's path."""
        if isinstance(source, cls):
            return source
        if isinstance(source, Mapping):
            return cls.from_dict(source)
        return cls.from_json(source)

    def to_dict(self) -> dict[str, Any]:
        """The dict a checkpoint saves: every key in order, sections as objects, the values as
        given (``optim.betas`` a list); ``from_dict`` of it gives this config back."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.to_dict() if isinstance(value, _Section) else _plain(value)
        return out


# ---------------------------------------------------------------------------- moee train
@dataclass(frozen=True, kw_only=True)
class TrainSettings:
    """What ``moee train`` runs (``moee.moe.trainer.train``): the config file, read and checked
    into :attr:`training` when the settings are built, and how the run starts and stops."""

    config: str = field(metadata={"help": "training config (JSON; see moee/moe/README_TRAINING.md)"})
    resume: bool = field(
        default=False,
        metadata={"help": "continue from the latest checkpoint in checkpoint.dir", "exclusive": "mode"},
    )
    overwrite: bool = field(
        default=False,
        metadata={
            "help": "start a fresh run in a checkpoint.dir that holds an earlier run, deleting its "
            "checkpoints and log",
            "exclusive": "mode",
        },
    )
    stop_at_step: int | None = field(
        default=None,
        metadata={"help": "checkpoint and stop after this step (schedule unchanged)", "type": int},
    )
    progress: bool = field(default=True, metadata={"help": "disable the progress bar"})
    #: the configuration read from ``config``
    training: TrainingConfig = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.resume and self.overwrite:
            raise ValueError(
                "--resume and --overwrite exclude each other: --resume continues the run, --overwrite replaces it"
            )
        if self.stop_at_step is not None:
            _check_int("--stop-at-step", self.stop_at_step, 1)
        object.__setattr__(self, "training", TrainingConfig.from_json(self.config))
