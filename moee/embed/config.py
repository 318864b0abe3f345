"""EmbeddingConfig: the one typed, validated description of how texts become vectors.

Method, pooling, prompt, score, alpha and normalize, and the recipe options of
``moee.embed.recipes`` (``recipe``, prompt ensembles, ``hs_layer``, ``rw_layers``, ``reference``),
are declared and checked here only, each field with its command-line flag beside it
(``metadata``, read by ``moee.cli_options``); the embedder, the evaluation adapter and runner and
the CLI commands take an :class:`EmbeddingConfig` (``MoEEmbedder.encode`` still accepts the same
keywords and builds one).

**Where a configuration comes from.** A model folder may carry its own default configuration in
:data:`MODEL_CONFIG_FILE` (``moee_embedding.json``, the way sentence-transformers keeps its pooling
in the model folder): :func:`load_model_config` reads it (a local folder, or a Hub repository
through transformers' cache), :func:`save_model_config` writes it. Every entry point then applies
one rule, :func:`resolve_config`: an explicit argument, else the model's saved configuration, else
``EmbeddingConfig()``'s defaults. A model's reference statistics (``reference``) go with the
configuration they were fitted under (:func:`model_reference_for`): a changed pooling or prompt
drops them unless a reference is given explicitly. Its dict forms are
what is persisted, so they must not change: :meth:`EmbeddingConfig.to_dict` is the form of
``moee embed`` sidecars and shard manifests, :meth:`EmbeddingConfig.experiment_kwargs` the mteb
``experiment_kwargs`` that name result-cache folders
(``alpha_auto__method_moee_sum__pooling_last__prompt_none__score_native``). The recipe options
join both forms only when set, so every configuration without them keeps its persisted form byte
for byte, and every one with them gets its own result folder.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from os import PathLike
from pathlib import Path
from typing import Any

from moee.embed.methods import (
    DEFAULT_SCORE,
    METHOD_REGISTRY,
    METHODS,
    POOLINGS,
    SCORES,
    Method,
    method_spec,
)
from moee.embed.prompts import PROMPT_NAMES, resolve_prompt
from moee.embed.recipes import (
    PROMPT_SETS,
    RECIPE_NAMES,
    RECIPES,
    parse_hs_layer,
    parse_rw_layers,
    recipe_spec,
    rw_layer_indices,
)
from moee.embed.validation import check_alpha, check_choice

__all__ = [
    "AUTO_ALPHA",
    "MODEL_CONFIG_FILE",
    "MODEL_DEFAULT",
    "PAPER_FIELDS",
    "PAPER_HELP",
    "EmbeddingConfig",
    "check_config_fits_model",
    "config_label",
    "drop_model_reference",
    "load_model_config",
    "load_model_prompts",
    "normalize_prompts",
    "paper_field",
    "prompt_templates",
    "resolve_config",
    "save_model_config",
]

#: The configuration fields that change the pooled HS/RW features (everything but the method,
#: ``alpha`` and ``normalize``, which only combine them): what a trace cache and a reference key on.
FEATURE_FIELDS = ("pooling", "prompt", "score", "recipe", "hs_layer", "rw_layers", "reference")
#: The recipe options, persisted only when set (see the module docstring).
RECIPE_FIELDS = ("recipe", "hs_layer", "rw_layers", "reference")

#: Value of ``alpha`` that asks the evaluation for the label-free per-task choice
#: (``moee.evaluation.alpha``); a vector can only be computed once a number replaces it.
AUTO_ALPHA = "auto"

#: The paper's configuration (``EmbeddingConfig.paper()``, ``--paper``): MoEE (sum) of the last
#: token's HS and RW under PromptEOL, the dense softmax of the router logits.
PAPER_FIELDS: dict[str, Any] = {
    "method": "moee_sum",
    "pooling": "last",
    "prompt": "prompteol",
    "score": "softmax",
}
#: The help of ``--paper`` (a field of every embedding command's settings).
PAPER_HELP = (
    "the paper's configuration as explicit flags (MoEE sum, PromptEOL, last token, softmax scores) "
    "instead of the model's; other flags given override it (evaluate: for every method of --methods)"
)

#: The file in a model folder that holds the model's own embedding configuration.
MODEL_CONFIG_FILE = "moee_embedding.json"
MODEL_CONFIG_FORMAT = "moee-embedding-config"
MODEL_CONFIG_VERSION = 1


class _ModelDefault:
    """The default of a configuration keyword left to the model (:func:`resolve_config` skips it)."""

    def __repr__(self) -> str:
        return "<the model's configuration>"


#: Default of every configuration keyword of the Python API (``encode``, ``trace``, the mteb
#: encoder, ``TraceCache``): the value comes from the model's saved configuration, else the library's.
MODEL_DEFAULT: Any = _ModelDefault()


# ---------------------------------------------------------------------------- command-line forms
# The ``type`` of a field's flag (``moee.cli_options``): the text of a flag as the field's value.
def prompt_flag(value: str) -> str | tuple[str, ...] | None:
    """One ``--prompt`` value: ``none`` (no prompt), a JSON list (``'["prompteol", "Q: {text}"]'``, an
    ensemble), comma-separated prompt names (an ensemble), or one name or ``{text}`` template. A value
    that reads both as one template and as a list (``prompteol,Q: {text}``: every comma-separated part
    is itself a prompt), or that looks like a JSON list but is not one, is refused: repeat ``--prompt``
    per prompt or give a JSON list (names and templates are checked by :class:`EmbeddingConfig`)."""
    import argparse

    text = value.strip()
    if text.lower() == "none":
        return None
    if text.startswith("[") and text.endswith("]"):
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            items = None
        if not isinstance(items, list) or not items or not all(isinstance(i, str) for i in items):
            raise argparse.ArgumentTypeError(
                f"--prompt {value!r} looks like a JSON list but is not a non-empty JSON list of strings; "
                "a template that starts with '[' is written as a list of one: '[\"[{text}]\"]'"
            )
        return items[0] if len(items) == 1 else tuple(items)
    parts = [v.strip() for v in value.split(",") if v.strip()]
    if "{text}" in value:
        if len(parts) > 1 and all(p in PROMPT_NAMES or p in PROMPT_SETS or "{text}" in p for p in parts):
            raise argparse.ArgumentTypeError(
                f"--prompt {value!r} is ambiguous: one template with a comma, or an ensemble of "
                f"{len(parts)} prompts? Give each prompt its own --prompt, or a JSON list "
                '(\'["prompteol", "Q: {text}"]\' for the ensemble, \'["a, {text}"]\' for one template)'
            )
        return value
    return parts[0] if len(parts) == 1 else tuple(parts)


def alpha_flag(value: str) -> float | str:
    """A number, or ``auto`` (the evaluation's label-free choice)."""
    import argparse

    if value == AUTO_ALPHA:
        return value
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"alpha must be a number >= 0 or 'auto', got {value!r}") from None


def recipe_flag(value: str) -> str | None:
    """``none`` is the plain recipe."""
    return None if value == "none" else value


def reference_flag(value: str) -> str | None:
    """An absolute path (sidecars record where the file is, usable from any directory), or ``none``:
    no standardisation, also where the model's configuration carries a reference."""
    return None if value == "none" else str(Path(value).resolve())


def normalize_prompt(prompt: Any) -> str | tuple[str, ...] | None:
    """A prompt argument in its canonical form: ``None``, one name/template, or a tuple of several
    (an ensemble; a list of one is that one prompt). Checked by :func:`prompt_templates`."""
    if isinstance(prompt, (list, tuple)):
        items = tuple(prompt)
        if not items:
            raise ValueError("a prompt ensemble needs at least one prompt")
        if any(p is None for p in items):
            raise ValueError(
                "a prompt ensemble cannot hold None (no prompt); use a template such as '{text}'"
            )
        return items[0] if len(items) == 1 else items
    return prompt


def prompt_templates(prompt: str | tuple[str, ...] | None) -> tuple[str | None, ...]:
    """The templates of a prompt argument, one per ensemble member (``(None,)`` for no prompt);
    a name of :data:`moee.embed.recipes.PROMPT_SETS` expands to its members."""
    prompt = normalize_prompt(prompt)
    if isinstance(prompt, str) and prompt in PROMPT_SETS:
        prompt = PROMPT_SETS[prompt]
    if isinstance(prompt, tuple):
        return tuple(resolve_prompt(p) for p in prompt)
    return (resolve_prompt(prompt),)


def prompt_label(prompt: str | tuple[str, ...] | None) -> str:
    """The prompt as result folders record it: its name, ``none``, the template, or an ensemble's
    members joined by ``+``."""
    prompt = normalize_prompt(prompt)
    if prompt is None:
        return "none"
    return "+".join(prompt) if isinstance(prompt, tuple) else prompt


def paper_field() -> Any:
    """The ``--paper`` field of an embedding command's settings (:data:`PAPER_HELP`)."""
    return field(default=False, metadata={"help": PAPER_HELP})


def check_alpha_or_auto(alpha: Any) -> float | str:
    """A finite ``alpha >= 0`` as a float, or :data:`AUTO_ALPHA`."""
    if isinstance(alpha, str):
        if alpha != AUTO_ALPHA:
            raise ValueError(f"alpha must be a number >= 0 or {AUTO_ALPHA!r}, got {alpha!r}")
        return alpha
    return check_alpha(alpha)


@dataclass(frozen=True)
class EmbeddingConfig:
    """How texts become vectors: ``method`` (see ``moee.embed.methods.METHOD_REGISTRY``), token
    ``pooling``, ``prompt`` (``None``, a prompt name or a ``{text}`` template), routing ``score``,
    the MoEE(sum) weight ``alpha`` (a number, or ``"auto"`` in the evaluation) and ``normalize``.

    Frozen and checked on construction, so a config that exists is a valid one.
    """

    method: str = field(default="moee_sum", metadata={"help": "embedding method", "choices": METHODS})
    pooling: str = field(default="last", metadata={"help": "token pooling", "choices": POOLINGS})
    prompt: str | tuple[str, ...] | None = field(
        default=None,
        metadata={
            "help": f"'none', one of {', '.join(PROMPT_NAMES)}, a template containing {{text}} or 'stability' "
            "(the nine stability prompts); an ensemble: repeat --prompt, or a JSON list "
            '(\'["prompteol", "Q: {text}"]\'), or comma-separated names',
            "type": prompt_flag,
            "repeatable": True,
            "metavar": "PROMPT",
            "default_text": "none",
        },
    )
    score: str = field(
        default=DEFAULT_SCORE,
        metadata={
            "help": "routing scores: native (the architecture's own rule), softmax (the paper's), "
            "selection, logits",
            "choices": SCORES,
        },
    )
    alpha: float | str = field(
        default=1.0,
        metadata={
            "help": "RW weight of moee_sum: a number >= 0, or 'auto' (the evaluation's label-free choice per task)",
            "type": alpha_flag,
            "metavar": "ALPHA",
            "default_text": "1",
        },
    )
    normalize: bool = field(
        default=True,
        metadata={"help": "unit-length rows (--no-normalize: as combined)", "default_text": "normalised"},
    )
    recipe: str | None = field(
        default=None,
        metadata={
            "help": "training-free recipe",
            "choices": (None, *RECIPE_NAMES),
            "type": recipe_flag,
            "metavar": "{" + ",".join(("none", *RECIPE_NAMES)) + "}",
            "default_text": "none",
            "group": "recipes",
        },
    )
    hs_layer: int | tuple[int, int] | None = field(
        default=None,
        metadata={
            "help": "HS from decoder layer I (negative from the end) or the mean of layers START:STOP",
            "metavar": "I|START:STOP",
            "default_text": "the final norm",
            "group": "recipes",
        },
    )
    rw_layers: tuple[int, ...] | tuple[tuple[int, float], ...] | None = field(
        default=None,
        metadata={
            "help": "RW from these MoE layers 'I,J,..' or with per-layer weights 'I:W,J:W,..'",
            "metavar": "LAYERS",
            "default_text": "all",
            "group": "recipes",
        },
    )
    reference: str | None = field(
        default=None,
        metadata={
            "help": "z-score HS and RW per dimension with a reference written by `moee fit-reference` "
            "('none': no standardisation, also where the model's configuration has a reference)",
            "type": reference_flag,
            "metavar": "FILE",
            "default_text": "none",
            "group": "recipes",
        },
    )

    def __post_init__(self) -> None:
        method_spec(self.method)
        object.__setattr__(self, "prompt", normalize_prompt(self.prompt))
        check_choice("pooling", self.pooling, POOLINGS)
        prompt_templates(self.prompt)  # a typo must not become a literal prompt
        check_choice("score", self.score, SCORES)
        object.__setattr__(self, "alpha", check_alpha_or_auto(self.alpha))
        object.__setattr__(self, "normalize", bool(self.normalize))
        recipe_spec(self.recipe)
        object.__setattr__(self, "hs_layer", parse_hs_layer(self.hs_layer))
        object.__setattr__(self, "rw_layers", parse_rw_layers(self.rw_layers))
        if self.reference is not None:
            if not isinstance(self.reference, (str, PathLike)):
                raise TypeError(f"reference must be a path, got {type(self.reference).__name__}")
            object.__setattr__(self, "reference", str(self.reference))

    @classmethod
    def paper(cls, **changes: Any) -> EmbeddingConfig:
        """The paper's configuration: MoEE (sum) of the last token's HS and RW under PromptEOL,
        the dense softmax of the router logits, no recipe (``changes`` override fields, e.g.
        ``alpha``). :data:`PAPER_FIELDS` are the fields it sets."""
        return cls(**{**PAPER_FIELDS, **changes})

    # ---------------------------------------------------------------- derived facts
    @property
    def spec(self) -> Method:
        """The method's registry entry."""
        return METHOD_REGISTRY[self.method]

    @property
    def uses_alpha(self) -> bool:
        return self.spec.uses_alpha

    @property
    def prompt_template(self) -> str | None | list[str | None]:
        """The template (``None`` for no prompt), or the list of an ensemble's templates."""
        templates = self.prompt_templates
        return templates[0] if not self.is_ensemble else list(templates)

    @property
    def prompt_templates(self) -> tuple[str | None, ...]:
        """One template per ensemble member (a single prompt is an ensemble of one)."""
        return prompt_templates(self.prompt)

    @property
    def is_ensemble(self) -> bool:
        return len(self.prompt_templates) > 1

    @property
    def prompt_label(self) -> str:
        """The prompt as result folders record it: its name, ``none``, the template, or ``a+b``."""
        return prompt_label(self.prompt)

    @property
    def recipe_label(self) -> str:
        """What the recipe options add to a label, e.g. ``echo, hs_layer=4`` (empty when none is set)."""
        return recipe_label(self.experiment_kwargs())

    def feature_key(self) -> tuple:
        """What the pooled features depend on (:data:`FEATURE_FIELDS`): a trace cache's key."""
        return tuple(getattr(self, f) for f in FEATURE_FIELDS)

    def feature_dict(self) -> dict[str, Any]:
        """The feature configuration as JSON (a reference records and checks it), without the
        reference itself, with the prompt as its templates and the RW layers without their weights."""
        return {
            "pooling": self.pooling,
            "prompt_templates": list(self.prompt_templates),
            "score": self.score,
            "recipe": self.recipe,
            "hs_layer": _jsonable(self.hs_layer),
            # the layers only: their weights apply after standardisation (``MoEEmbedder.features``)
            "rw_layers": rw_layer_indices(self.rw_layers),
        }

    @property
    def label(self) -> str:
        """A short human label, e.g. ``MoEE sum + PromptEOL (alpha=auto)``."""
        return config_label(self.experiment_kwargs())

    def width(self, hidden_size: int, n_layers: int, n_experts: int) -> int:
        """Width of this configuration's vectors for a model of that shape (``n_layers`` MoE layers,
        of which ``rw_layers`` keeps some)."""
        kept = n_layers if self.rw_layers is None else len(self.rw_layers)
        return self.spec.width(hidden_size, kept * n_experts)

    def numeric_alpha(self) -> float:
        """``alpha`` as the number ``combine`` needs (``"auto"`` must be resolved per task first)."""
        if self.alpha == AUTO_ALPHA:
            raise ValueError("alpha='auto' is chosen per task by the evaluation; give a number to embed")
        return float(self.alpha)

    def replace(self, **changes: Any) -> EmbeddingConfig:
        """A copy with ``changes`` (checked again)."""
        return replace(self, **changes)

    # ---------------------------------------------------------------- persisted forms
    def to_dict(self) -> dict[str, Any]:
        """The sidecar / shard-manifest form (``moee embed``); key order is part of the format.
        The recipe options follow, each only when set."""
        return {
            "method": self.method,
            "pooling": self.pooling,
            "prompt": list(self.prompt) if isinstance(self.prompt, tuple) else self.prompt,
            "prompt_template": self.prompt_template,
            "score": self.score,
            "alpha": self.alpha,
            "normalize": self.normalize,
            **self._recipe_items(),
        }

    def to_record(self) -> dict[str, Any]:
        """:meth:`to_dict` as a result file records it: the reference path named like a model
        (`moee.provenance.model_label`, relative under the working directory or the package), so a
        committed result does not carry the folders of the machine that made it. Sidecars keep
        :meth:`to_dict`, whose absolute path a later command in another directory still opens."""
        from moee.provenance import model_label

        values = self.to_dict()
        if self.reference is not None:
            values["reference"] = model_label(self.reference)
        return values

    def _recipe_items(self) -> dict[str, Any]:
        return {n: _jsonable(getattr(self, n)) for n in RECIPE_FIELDS if getattr(self, n) is not None}

    def reference_digest(self) -> str | None:
        """Short sha256 of the reference's statistics (``None`` without one)."""
        if self.reference is None:
            return None
        from moee.embed.reference import file_digest

        return file_digest(self.reference)

    def experiment_kwargs(self) -> dict[str, Any]:
        """The mteb ``experiment_kwargs`` form, which names result-cache folders.

        ``alpha`` is recorded only for methods that use it: recording it elsewhere would split
        identical results across folders. ``normalize`` is not recorded (the evaluation always
        normalises; cosine is scale-free).
        """
        kwargs: dict[str, Any] = {
            "method": self.method,
            "pooling": self.pooling,
            "prompt": self.prompt_label,
            "score": self.score,
        }
        if self.uses_alpha:
            kwargs["alpha"] = self.alpha
        # the reference by the hash of its statistics: its path says nothing about its numbers
        for name in RECIPE_FIELDS:
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = self.reference_digest() if name == "reference" else _label_value(name, value)
        return kwargs

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EmbeddingConfig:
        """Read :meth:`to_dict` or :meth:`experiment_kwargs` forms back (other keys are ignored;
        ``prompt="none"`` is no prompt, a missing key takes its default)."""
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        if values.get("prompt") == "none":
            values["prompt"] = None
        prompt = values.get("prompt")
        if isinstance(prompt, str) and "+" in prompt and "{text}" not in prompt:  # an ensemble's label
            values["prompt"] = tuple(prompt.split("+"))
        if values.get("normalize") is None:
            values.pop("normalize", None)
        if isinstance(values.get("rw_layers"), dict):  # JSON keys are strings
            values["rw_layers"] = {int(k): v for k, v in values["rw_layers"].items()}
        return cls(**values)


def _jsonable(value: Any) -> Any:
    """Tuples as lists, ``(index, weight)`` pairs as a ``{index: weight}`` dict (JSON forms)."""
    if isinstance(value, tuple):
        if value and all(isinstance(v, tuple) for v in value):
            return {str(i): w for i, w in value}
        return list(value)
    return value


def _label_value(name: str, value: Any) -> Any:
    """A recipe option as it names a result folder: ``hs_layer`` ``4`` or ``2:6``, ``rw_layers``
    ``0,2`` or ``0:0.5,2:1``."""
    if name == "hs_layer" and isinstance(value, tuple):
        return f"{value[0]}:{value[1]}"
    if name == "rw_layers":
        return ",".join(f"{v[0]}:{v[1]:g}" if isinstance(v, tuple) else str(v) for v in value)
    return value


def recipe_label(settings: Mapping[str, Any]) -> str:
    """The recipe options of an ``experiment_kwargs`` dict as label text (empty when none)."""
    parts = []
    for name in RECIPE_FIELDS:
        if settings.get(name) is None:
            continue
        value = settings[name]
        parts.append(RECIPES[value].label if name == "recipe" and value in RECIPES else f"{name}={value}")
    return ", ".join(parts)


def config_label(settings: Mapping[str, Any]) -> str:
    """The label of an ``experiment_kwargs`` dict, also one written by another moee version
    (an unknown method is shown by its name)."""
    method = settings["method"]
    spec = METHOD_REGISTRY.get(method)
    text = spec.label if spec is not None else method
    prompt = settings.get("prompt", "none")
    if prompt != "none":
        text += " + PromptEOL" if prompt == "prompteol" else f" + prompt {prompt}"
    extras = [recipe_label(settings)] if recipe_label(settings) else []
    if spec is not None and spec.uses_alpha:
        extras.append(f"alpha={settings.get('alpha')}")
    if settings.get("pooling", "last") != "last":
        extras.append(f"pooling={settings['pooling']}")
    if settings.get("score", DEFAULT_SCORE) != DEFAULT_SCORE:
        extras.append(f"score={settings['score']}")
    return text + (f" ({', '.join(extras)})" if extras else "")


# ---------------------------------------------------------------------------- the resolution rule
def resolve_config(model_config: EmbeddingConfig | None = None, /, **explicit: Any) -> EmbeddingConfig:
    """The configuration every entry point uses: each field an explicit argument gives (a keyword
    not left at :data:`MODEL_DEFAULT`), else the model's saved configuration (``model_config``,
    :func:`load_model_config`), else ``EmbeddingConfig()``'s default."""
    given = {k: v for k, v in explicit.items() if v is not MODEL_DEFAULT}
    names = {f.name for f in fields(EmbeddingConfig)}
    unknown = sorted(set(given) - names)
    if unknown:
        raise TypeError(
            f"unknown configuration field(s) {', '.join(unknown)}; fields: {', '.join(sorted(names))}"
        )
    if model_config is not None and not isinstance(model_config, EmbeddingConfig):
        raise TypeError(f"model_config must be an EmbeddingConfig or None, got {type(model_config).__name__}")
    resolved = (model_config if model_config is not None else EmbeddingConfig()).replace(**given)
    if "reference" not in given and model_config is not None and model_config.reference is not None:
        resolved = resolved.replace(reference=model_reference_for(model_config, resolved))
    return resolved


def model_reference_for(model_config: EmbeddingConfig, config: EmbeddingConfig) -> str | None:
    """The model's reference where it standardises ``config``'s features, else ``None``.

    A model's reference is fitted under the model's own feature configuration, so it goes with
    every method, alpha and subset of its MoE layers, but a changed pooling, prompt, score, recipe
    or HS layer leaves the vectors unstandardised (the resolved configuration then records no
    reference) rather than refusing the change."""
    if config.feature_dict() == model_config.feature_dict():
        return model_config.reference
    from moee.embed.reference import load_cached

    reference = load_cached(model_config.reference)
    features = config.feature_dict()
    fitted = reference.meta.get("features", {})
    if "max_length" in fitted:  # the embedder's cut, not the configuration's: checked where it is used
        features["max_length"] = fitted["max_length"]
    return model_config.reference if reference.accepts(features) else None


# ---------------------------------------------------------------------------- the model's own file
def _model_file(name_or_path: str | PathLike, filename: str, *, local_only: bool, **hub: Any) -> Path | None:
    """``filename`` of a local model folder, or of a Hub repository (through transformers' cache,
    downloaded when online); ``None`` when the model has none."""
    local = Path(name_or_path).expanduser()
    if local.is_dir():
        path = local / filename
        return path if path.is_file() else None
    if local_only or local.exists():
        return None
    from transformers.utils import cached_file

    from moee.loading import check_model_source

    check_model_source(name_or_path)  # a local path that does not exist: named as such, not as a Hub id

    found = cached_file(
        str(name_or_path),
        filename,
        _raise_exceptions_for_missing_entries=False,
        _raise_exceptions_for_connection_errors=False,
        **{k: v for k, v in hub.items() if v is not None},
    )
    return Path(found) if found else None


def _leaves_folder(reference: str) -> bool:
    """Whether a relative ``reference`` of a model's :data:`MODEL_CONFIG_FILE` names a file outside
    the model folder (``../x.safetensors``, ``a/../../x``): judged on the name, so a folder whose
    files are links elsewhere (the Hub cache's) still holds its own reference."""
    normal = os.path.normpath(reference)
    return normal == os.pardir or normal.startswith(os.pardir + os.sep)


def load_model_config(
    name_or_path: str | PathLike,
    *,
    local_only: bool = False,
    revision: str | None = None,
    cache_dir: str | PathLike | None = None,
) -> EmbeddingConfig | None:
    """The embedding configuration saved with a model (:data:`MODEL_CONFIG_FILE` in its folder or
    Hub repository), or ``None`` when it has none. ``local_only`` never looks at the Hub.

    A relative ``reference`` names a file inside the model folder and is resolved there, so a
    copied or downloaded folder brings its statistics along. A file of another format or a newer
    version, or with unknown fields, is an error naming the file; so is a relative ``reference``
    that leaves the folder (an absolute one is used as it is)."""
    hub = {"revision": revision, "cache_dir": cache_dir}
    path = _model_file(name_or_path, MODEL_CONFIG_FILE, local_only=local_only, **hub)
    if path is None:
        return None
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != MODEL_CONFIG_FORMAT:
        raise ValueError(f"{path} is not a moee embedding configuration (format {MODEL_CONFIG_FORMAT!r})")
    version = doc.get("format_version")
    if not isinstance(version, int) or version > MODEL_CONFIG_VERSION:
        raise ValueError(
            f"{path} has format_version {version!r}; this moee reads up to {MODEL_CONFIG_VERSION}: upgrade moee"
        )
    values = doc.get("config")
    if not isinstance(values, dict):
        raise ValueError(f"{path}: 'config' must be an object of EmbeddingConfig fields")
    unknown = sorted(set(values) - {f.name for f in fields(EmbeddingConfig)} - {"prompt_template"})
    if unknown:
        raise ValueError(f"{path}: unknown configuration field(s) {', '.join(unknown)}")
    reference = values.get("reference")
    if isinstance(reference, str) and not Path(reference).is_absolute():
        from moee.embed.reference import reference_paths

        if _leaves_folder(reference):
            raise ValueError(
                f"{path}: 'reference' is {reference!r}, which leaves the model folder; a relative reference "
                "names a file inside the folder: copy the .safetensors and its .json into the folder and name "
                "it relative to it (e.g. 'reference.safetensors'), or name a reference kept elsewhere by its "
                "absolute path"
            )

        tensors, sidecar = (
            _model_file(name_or_path, str(rel), local_only=local_only, **hub)
            for rel in reference_paths(reference)
        )
        if tensors is None or sidecar is None:
            raise FileNotFoundError(
                f"{path} names the reference {reference!r}, which the model folder lacks (with its .json)"
            )
        values = {**values, "reference": str(tensors)}
    try:
        config = EmbeddingConfig.from_dict(values)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    if config.alpha == AUTO_ALPHA:
        raise ValueError(f"{path}: alpha must be a number (a model's configuration embeds texts)")
    return config


def normalize_prompts(prompts: Mapping[str, Any] | None) -> dict[str, str | tuple[str, ...] | None]:
    """A model's named prompts (name -> any ``prompt`` value: ``None``, a name, a ``{text}`` template
    or an ensemble), each checked like ``EmbeddingConfig.prompt``; ``query`` and ``document`` are
    what ``encode_query`` / ``encode_document`` use, the way sentence-transformers names them."""
    if prompts is None:
        return {}
    if not isinstance(prompts, Mapping):
        raise TypeError(f"prompts must be a mapping of name -> prompt, got {type(prompts).__name__}")
    out: dict[str, str | tuple[str, ...] | None] = {}
    for name, prompt in prompts.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"a prompt name must be a non-empty str, got {name!r}")
        try:
            prompt = normalize_prompt(prompt)
            prompt_templates(prompt)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"prompt {name!r}: {exc}") from None
        out[name] = prompt
    return out


def load_model_prompts(
    name_or_path: str | PathLike,
    *,
    local_only: bool = False,
    revision: str | None = None,
    cache_dir: str | PathLike | None = None,
) -> dict[str, str | tuple[str, ...] | None]:
    """The named prompts saved with a model (the ``prompts`` object of its
    :data:`MODEL_CONFIG_FILE`; empty when it has none)."""
    path = _model_file(
        name_or_path, MODEL_CONFIG_FILE, local_only=local_only, revision=revision, cache_dir=cache_dir
    )
    if path is None:
        return {}
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    prompts = doc.get("prompts") if isinstance(doc, dict) else None
    try:
        return normalize_prompts(
            {k: list(v) if isinstance(v, list) else v for k, v in (prompts or {}).items()}
        )
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None


def save_model_config(
    config: EmbeddingConfig,
    directory: str | PathLike,
    *,
    prompts: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``config`` as a model folder's :data:`MODEL_CONFIG_FILE` (returns its path), with the
    model's named ``prompts`` (:func:`normalize_prompts`) when given. A reference is copied into
    the folder (``.safetensors`` and ``.json``) and named relative to it."""
    if not isinstance(config, EmbeddingConfig):
        raise TypeError(f"config must be an EmbeddingConfig, got {type(config).__name__}")
    config.numeric_alpha()  # a model's configuration embeds texts: 'auto' is the evaluation's
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    values = config.to_dict()
    if config.reference is not None:
        from moee.embed.reference import reference_paths

        tensors, sidecar = reference_paths(config.reference)
        for source in (tensors, sidecar):
            target = directory / source.name
            if not target.exists() or not target.samefile(source):
                shutil.copyfile(source, target)
        values["reference"] = tensors.name
    doc: dict[str, Any] = {
        "format": MODEL_CONFIG_FORMAT,
        "format_version": MODEL_CONFIG_VERSION,
        "config": values,
    }
    named = normalize_prompts(prompts)
    if named:
        doc["prompts"] = {k: list(v) if isinstance(v, tuple) else v for k, v in named.items()}
    path = directory / MODEL_CONFIG_FILE
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return path


def drop_model_reference(directory: str | PathLike) -> str | None:
    """Remove the reference statistics a model folder's :data:`MODEL_CONFIG_FILE` names (their name
    in the file, and the ``.safetensors`` and ``.json`` pair when it lies in the folder); returns
    the name, or ``None`` when it names none.

    Why: statistics are fitted on one set of weights; a folder whose weights are rewritten (a new
    export of a model) must not keep standardising with the old ones, nor name files it lacks. The
    rest of the configuration (method, pooling, prompts) stays; ``moee fit-reference
    --save-to-model`` fits new statistics."""
    directory = Path(directory)
    path = directory / MODEL_CONFIG_FILE
    if not path.is_file():
        return None
    doc = json.loads(path.read_text(encoding="utf-8"))
    values = doc.get("config") if isinstance(doc, dict) else None
    reference = values.pop("reference", None) if isinstance(values, dict) else None
    if not isinstance(reference, str):
        return None
    # a file outside the folder is not the folder's to remove
    if not Path(reference).is_absolute() and not _leaves_folder(reference):
        from moee.embed.reference import reference_paths

        for stale in reference_paths(directory / reference):
            stale.unlink(missing_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return reference


def check_config_fits_model(embedder: Any, config: EmbeddingConfig) -> None:
    """Refuse, right after the model loads and before any text is embedded, a configuration this
    model cannot embed: ``hs_layer`` / ``rw_layers`` out of range for its decoder / MoE layer
    counts, or a reference fitted on another model or configuration."""
    import numpy as np

    from moee.capture.registry import _decoder_layers
    from moee.embed.recipes import select_hs, select_rw

    where = f"for {getattr(embedder, 'name_or_path', 'the model')}"
    try:
        if config.hs_layer is not None:  # the selection itself, on a placeholder of the model's shape
            select_hs(np.zeros((1, len(_decoder_layers(embedder.model)), 1), np.float32), config.hs_layer)
        if config.rw_layers is not None:
            select_rw(np.zeros((1, embedder.n_moe_layers, 1), np.float32), config.rw_layers)
    except ValueError as exc:
        raise ValueError(f"--hs-layer/--rw-layers {where}: {exc}") from None
    if config.reference is not None:
        from moee.embed.reference import load_cached

        embedder.check_reference(load_cached(config.reference), config)
