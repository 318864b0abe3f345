"""The command line's embedding and loading flags, built from the fields of ``EmbeddingConfig`` and
``LoadOptions``: no command types a flag list.

Each field declares its flag beside itself, in ``dataclasses.field(metadata=...)``:

- ``help`` (required): what the flag does; the default is added to it;
- ``choices``, ``type`` (flag text -> value), ``metavar``;
- ``default_text``: how the library default reads in ``--help`` (else the default itself);
- ``group``: a key of :data:`GROUPS` (e.g. the recipe flags);
- ``flag``: the flag's name when it is not ``--field-name`` (``--allow-bin``);
- ``repeatable``: the flag may be given several times, its values joined into one tuple (an
  ensemble of ``--prompt``); ``None`` (``none``) cannot be joined with others;
- ``nargs``: argparse's (``"+"``: several values after one flag); ``action``: ``"append"`` only (the
  flag may be given several times, each value kept);
- ``embed``: the field holds a flags dataclass (``LoadOptions``, ``ServerSettings``, ...;
  ``EmbeddingConfig``, whose flags are then explicit, but for the fields in ``exclude``): its flags
  are added instead of one. An ``EmbeddingConfig`` is resolved against the model of the first set
  field of ``model_from`` (default ``("model",)``), or kept as the flags given (``resolve``: false);
- ``positional``: the field is a positional argument (named as the field), not a ``--flag``;
- ``exclusive``: a name shared by the fields whose flags exclude each other (one group; the group
  is required when one of them says ``required``);
- ``no_flag``: true for a setting only Python callers give (a run's recorded command, extra
  configurations): it has no flag.

A field without a default is a required flag, as is one whose metadata says ``required`` (a setting
a library caller may leave unset, e.g. an output folder). A field with ``init=False`` (a value the
settings derive) is no flag. A command's settings class (``moee report``'s
``ReportSettings``, ...) is such a dataclass: :func:`add_field_arguments` adds its flags and
:func:`settings_of` builds it from the parsed flags, so a new setting is one field.

A bool embedding field becomes ``--<name>`` / ``--no-<name>``; a bool loading field whose default
is false becomes ``--<name>`` (true: ``--no-<name>``). Adding an embedding option is one ``EmbeddingConfig`` field with this metadata: it
becomes a flag of every embedding command (``moee embed``, ``fit-reference``, ``evaluate``; ``moee
search`` embeds its queries with the configuration its corpus sidecar records), and
:func:`explicit_config` reads it back.

Embedding flags are absent unless given (``argparse.SUPPRESS``): :func:`explicit_config` holds only
the flags given, so every other field comes from the model's saved configuration, else the library
default (``moee.embed.config.resolve_config``), and ``--help`` says so. Loading flags default to
their field's default (there is no per-model loading configuration).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import MISSING, Field, fields
from pathlib import Path
from typing import Any

from moee.corpus import make_encoder  # re-exported: it moved to the library
from moee.embed.config import PAPER_FIELDS, PAPER_HELP, EmbeddingConfig, load_model_config, resolve_config
from moee.loading import LoadOptions

__all__ = [
    "GROUPS",
    "METADATA_KEYS",
    "add_embedding_arguments",
    "add_field_arguments",
    "add_loading_arguments",
    "embedding_config",
    "explicit_config",
    "load_from_args",
    "load_options",
    "make_encoder",
    "model_config_of",
    "settings_of",
]

#: The metadata keys a field's flag may declare (others are an error: a typo must not vanish).
METADATA_KEYS = frozenset(
    {
        "help",
        "choices",
        "type",
        "metavar",
        "default_text",
        "group",
        "flag",
        "repeatable",
        "nargs",
        "action",
        "embed",
        "exclude",
        "required",
        "positional",
        "exclusive",
        "model_from",
        "resolve",
        "no_flag",
    }
)
#: Argument groups fields may name (``group``), by their title in ``--help``.
GROUPS = {
    "recipes": "recipes (docs/RECIPES.md)",
    "serve-limits": "batching and limits",
    "serve-access": "access",
    "serve-connections": "connections",
    "embed-ray": "Ray (--engine ray; the moee[ray] extra, docs/SCALING.md)",
    "embed-sharding": "sharding (multi-process / multi-GPU)",
}

#: How the help of an embedding flag names its default.
MODEL_DEFAULT_TEXT = "the model's saved configuration, else {}"


class _Repeated(argparse.Action):
    """A repeatable flag: one value as given, several joined into one tuple (each value may itself
    be a tuple, e.g. a JSON list of prompts)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        key = "_repeated_" + self.dest  # per parse: the values given so far
        given = getattr(namespace, key, None) or []
        given.append(values)
        setattr(namespace, key, given)
        if len(given) > 1 and any(v is None for v in given):
            parser.error(f"{option_string} none cannot be combined with other {option_string} values")
        joined = tuple(item for v in given for item in (v if isinstance(v, tuple) else (v,)))
        setattr(namespace, self.dest, values if len(given) == 1 else joined)


def _flag_name(f: Field, explicit: bool) -> str:
    name = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
    if f.type in (bool, "bool") and f.default is True and not explicit and "flag" not in f.metadata:
        name = "--no-" + f.name.replace("_", "-")
    return name


def _default_text(f: Field) -> str:
    if "default_text" in f.metadata:
        return str(f.metadata["default_text"])
    if f.type in (bool, "bool"):
        return "on" if f.default else "off"
    return str(f.default)


def add_field_arguments(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    explicit: bool,
    exclude: Mapping[str, str] | set[str] | tuple[str, ...] = (),
) -> list[str]:
    """One flag per field of the dataclass ``cls`` (see the module docstring), except ``exclude``;
    returns the field names added. ``explicit``: flags are absent unless given, and their help
    names the model's saved configuration as the default."""
    groups: dict[str, Any] = {}
    exclusive: dict[str, Any] = {}
    added = []
    for f in fields(cls):
        if f.name in exclude or not f.init or f.metadata.get("no_flag"):
            continue
        meta = dict(f.metadata)
        unknown = set(meta) - METADATA_KEYS
        if _embeds(f, EmbeddingConfig):
            added += add_embedding_arguments(parser, exclude=meta.get("exclude", {}), paper=False)
            continue
        if isinstance(meta.get("embed"), type):  # LoadOptions, ServerSettings, ...: their own flags
            added += add_field_arguments(parser, meta["embed"], explicit=False)
            continue
        if unknown or "help" not in meta or meta.get("action", "append") != "append":
            raise TypeError(
                f"{cls.__name__}.{f.name}: flag metadata needs 'help' and takes only "
                f"{', '.join(sorted(METADATA_KEYS))}; got {', '.join(sorted(meta))}"
            )
        default = MODEL_DEFAULT_TEXT.format(_default_text(f)) if explicit else _default_text(f)
        # a value default is worth saying; an unset (None) or off (bool) one is not
        required = meta.get("required", False) or (f.default is MISSING and f.default_factory is MISSING)
        empty = any(_field_default(f) is v for v in (None, True, False)) or _field_default(f) in ((), [])
        shown = explicit or "default_text" in meta or not (required or empty)
        help_text = meta["help"] + (f" (default: {default})" if shown else "")
        kwargs: dict[str, Any] = {"dest": f.name, "help": help_text}
        if f.type in (bool, "bool") and explicit:  # both ways: a model's False can be overridden too
            kwargs.update(action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS)
        elif f.type in (bool, "bool"):
            kwargs["action"] = "store_false" if f.default is True else "store_true"
        else:
            kwargs["default"] = argparse.SUPPRESS if explicit else _field_default(f)
            for key in ("choices", "type", "metavar", "nargs", "action"):
                if key in meta:
                    kwargs[key] = meta[key]
            if meta.get("repeatable"):
                kwargs["action"] = _Repeated
            if meta.get("action") == "append":  # argparse appends to a copy of a list default
                kwargs["default"] = list(kwargs["default"])
            if required:
                kwargs["required"] = True
                kwargs.pop("default")
        target = parser
        if "group" in meta:
            title = GROUPS[meta["group"]]
            target = groups.get(title) or groups.setdefault(title, parser.add_argument_group(title))
        if "exclusive" in meta:  # one of these flags at most (exactly one when one is required)
            key = meta["exclusive"]
            if key not in exclusive:
                members = [g for g in fields(cls) if g.metadata.get("exclusive") == key]
                needed = any(g.metadata.get("required") for g in members)
                exclusive[key] = target.add_mutually_exclusive_group(required=needed)
            target = exclusive[key]
            kwargs.pop("required", None)
            kwargs["default"] = _field_default(f)
        if meta.get("positional"):  # named as the field; argparse takes no dest for it
            del kwargs["dest"]
            kwargs.pop("required", None)
            target.add_argument(f.name, **kwargs)
        else:
            target.add_argument(_flag_name(f, explicit), **kwargs)
        added.append(f.name)
    return added


def _embeds(f: Field, options: type) -> bool:
    """Whether the field ``f`` embeds the flags of ``options`` (or of a class it extends)."""
    embed = f.metadata.get("embed")
    return isinstance(embed, type) and issubclass(options, embed)


def settings_of(cls: type, args: argparse.Namespace, **given: Any) -> Any:
    """The settings dataclass ``cls`` (:func:`add_field_arguments`' flags) from parsed flags: each
    field from its flag (an embedded flags dataclass, e.g. ``LoadOptions``, from its own flags; an
    ``EmbeddingConfig`` resolved as :func:`embedding_config` does against the model its
    ``model_from`` names, or the flags given when ``resolve`` is false), ``given`` for the fields
    that are no flag."""
    values: dict[str, Any] = {}
    embedded = []
    for f in fields(cls):
        if not f.init or f.name in given or f.metadata.get("no_flag"):
            continue
        if _embeds(f, EmbeddingConfig):
            embedded.append(f)  # after the other fields: it is resolved against their model
        elif isinstance(f.metadata.get("embed"), type):
            values[f.name] = settings_of(f.metadata["embed"], args)
        elif f.name in vars(args):
            value = getattr(args, f.name)
            values[f.name] = tuple(value) if isinstance(value, list) else value
    for f in embedded:
        if f.metadata.get("resolve", True):
            names = f.metadata.get("model_from", ("model",))
            known = {**values, **given}
            model = next((known[n] for n in names if known.get(n) is not None), None)
            values[f.name] = resolve_config(model_config_of(model), **explicit_config(args))
        else:
            values[f.name] = explicit_config(args)
    return cls(**values, **given)


def _field_default(f: Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return None


def add_embedding_arguments(
    parser: argparse.ArgumentParser, *, exclude: Mapping[str, str] = {}, paper: bool = True
) -> list[str]:
    """The embedding-configuration flags, one per ``EmbeddingConfig`` field except ``exclude``
    (field -> why the command takes it otherwise), plus ``--paper``; read with :func:`explicit_config`."""
    added = add_field_arguments(parser, EmbeddingConfig, explicit=True, exclude=exclude)
    if paper:
        parser.add_argument("--paper", action="store_true", help=PAPER_HELP)
    return added


def explicit_config(args: argparse.Namespace) -> dict[str, Any]:
    """The embedding fields the command line gives: the flags given (``--paper``: the paper's
    fields under them), nothing for the flags left out."""
    given = {f.name: getattr(args, f.name) for f in fields(EmbeddingConfig) if f.name in vars(args)}
    return {**PAPER_FIELDS, **given} if getattr(args, "paper", False) else given


def model_config_of(model: str | Path | None) -> EmbeddingConfig | None:
    """The saved configuration of ``--model`` (``None``: the default model; a shipped model by its
    name), read without loading or assembling it."""
    from moee.models.bundled import config_dir

    return load_model_config(config_dir(model))


def embedding_config(args: argparse.Namespace, **changes: Any) -> EmbeddingConfig:
    """The configuration of a command: the flags given (and ``changes``), else the model's saved
    configuration, else the library default (``moee.embed.config.resolve_config``)."""
    return resolve_config(model_config_of(args.model), **{**explicit_config(args), **changes})


# ---------------------------------------------------------------------------- loading
def add_loading_arguments(parser: argparse.ArgumentParser, *, model: bool = True) -> None:
    """The model-loading flags, one per ``LoadOptions`` field (read with :func:`load_options`);
    ``model=True`` also adds ``--model``."""
    if model:
        from moee.models.bundled import DEFAULT_MODEL, MODEL_HELP

        parser.add_argument("--model", default=None, help=f"{MODEL_HELP} (default: {DEFAULT_MODEL})")
    add_field_arguments(parser, LoadOptions, explicit=False)


def load_options(args: argparse.Namespace) -> LoadOptions:
    """The :class:`LoadOptions` of :func:`add_loading_arguments`'s flags."""
    return LoadOptions.from_args(args)


def load_from_args(args: argparse.Namespace, **changes: Any) -> Any:
    """The model of ``--model`` loaded with the loading flags (``changes`` override some of them,
    e.g. the device of a shard)."""
    from moee.embed.embedder import MoEEmbedder

    return MoEEmbedder.from_pretrained(args.model, load_options(args).replace(**changes))
