"""Each converted command takes its flags from one frozen settings dataclass (``moee.cli_options``
builds them from the fields' metadata, ``settings_of`` reads them back), so a new setting is one
field: every flag of the command's parser comes from a field of its settings class (or of the
``LoadOptions`` / ``EmbeddingConfig`` it embeds), and a field added to the class becomes a flag
with no other edit. The commands not yet converted are listed by name, so the list only shrinks."""

from __future__ import annotations

import argparse
import importlib
import re
from dataclasses import FrozenInstanceError, dataclass, field, fields, is_dataclass
from pathlib import Path

import pytest

from moee.cli import build_parser
from moee.cli_options import add_field_arguments, settings_of
from moee.embed.config import EmbeddingConfig
from moee.loading import LoadOptions

#: a training config (``moee train``'s settings read --config when they are built)
TRAIN_CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "default_model.json")
#: command -> (its module, the name of its settings class there, the fewest arguments it parses)
CONVERTED = {
    "report": ("moee.commands.report", "ReportSettings", ["--corpus", "c.txt", "--out", "o"]),
    "ablate": ("moee.commands.ablate", "AblateSettings", ["--corpus", "c.txt", "--out", "o"]),
    "routes": ("moee.commands.routes", "RoutesSettings", ["--corpus", "c.txt", "--out", "o.parquet"]),
    "embed": ("moee.commands.embed", "EmbedSettings", ["in.txt", "--out", "e.npy"]),
    "fit-reference": ("moee.commands.fit_reference", "FitReferenceSettings", ["c.txt", "--out", "r"]),
    "search": ("moee.commands.search", "SearchSettings", ["--embeddings", "e.npy", "--query", "q"]),
    "serve": ("moee.commands.serve", "ServeSettings", []),
    "evaluate": ("moee.commands.evaluate", "EvalSettings", []),
    "quickstart": ("moee.commands.quickstart", "QuickstartSettings", []),
    "upcycle": (
        "moee.commands.upcycle",
        "UpcycleSettings",
        ["dense", "--out", "o", "--experts", "4", "--top-k", "2"],
    ),
    "simulate": ("moee.commands.simulate", "SimulateSettings", ["--out", "o"]),
    "train": ("moee.commands.train", "TrainSettings", ["--config", TRAIN_CONFIG]),
}
#: Commands whose flags are not (all) settings fields yet (none left): a new command is converted.
NOT_CONVERTED: tuple[str, ...] = ()


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings if o not in ("-h", "--help")}


def _settings_class(command: str) -> type:
    module, name, _ = CONVERTED[command]
    return getattr(importlib.import_module(module), name)


def _field_names(cls: type) -> set[str]:
    """The fields of ``cls`` and of the flags dataclasses it embeds."""
    names = set()
    for f in fields(cls):
        embedded = f.metadata.get("embed")
        names |= {g.name for g in fields(embedded)} if embedded else {f.name}
    return names


@pytest.mark.parametrize("command", sorted(CONVERTED))
def test_every_flag_of_a_converted_command_is_a_settings_field(command):
    cls = _settings_class(command)
    assert is_dataclass(cls) and cls.__dataclass_params__.frozen
    parser = _subparsers()[command]
    alone = argparse.ArgumentParser()
    add_field_arguments(alone, cls, explicit=False)
    assert _flags(parser) == _flags(alone)  # the command adds exactly the settings' flags
    dests = {a.dest for a in parser._actions if a.option_strings and a.dest != "help"}
    assert dests <= _field_names(cls)


def test_the_not_converted_list_names_real_commands_that_still_have_other_flags():
    parsers = _subparsers()
    assert not set(NOT_CONVERTED) & set(CONVERTED)
    assert set(NOT_CONVERTED) | set(CONVERTED) == set(parsers)  # a new command is one or the other
    for command in NOT_CONVERTED:  # converted: move it to CONVERTED
        own = _flags(parsers[command])
        from_options = argparse.ArgumentParser()
        add_field_arguments(from_options, LoadOptions, explicit=False)
        add_field_arguments(from_options, EmbeddingConfig, explicit=True)
        assert own - _flags(from_options), command


@pytest.mark.parametrize("command", sorted(CONVERTED))
def test_a_new_settings_field_becomes_a_flag_with_no_other_edit(command, monkeypatch):
    module, name, argv = CONVERTED[command]
    cls = _settings_class(command)

    @dataclass(frozen=True, kw_only=True)
    class Extended(cls):  # type: ignore[misc, valid-type]
        extra_knob: int = field(default=3, metadata={"help": "a setting added later", "type": int})

    monkeypatch.setattr(importlib.import_module(module), name, Extended)
    parser = _subparsers()[command]  # the command's own registration, unchanged
    assert "--extra-knob" in _flags(parser)
    assert "a setting added later (default: 3)" in parser.format_help().replace("\n", " ").replace("  ", " ")
    args = parser.parse_args([*argv, "--extra-knob", "5"])
    settings = settings_of(Extended, args)
    assert settings.extra_knob == 5 and settings_of(Extended, parser.parse_args(argv)).extra_knob == 3
    with pytest.raises(FrozenInstanceError):
        settings.extra_knob = 6  # type: ignore[misc]


@pytest.mark.parametrize(
    ("command", "argv", "message"),
    [
        ("report", ["--max-texts", "0"], "--max-texts must be >= 1, got 0"),
        ("report", ["--checkpoints", "only-one"], "--checkpoints needs at least two checkpoints"),
        ("ablate", ["--seq-len", "0"], "--seq-len must be a positive integer, got 0"),
        ("ablate", ["--layers", "1", "1"], "--layers names 1 twice"),
        ("ablate", ["--swap-from", "x", "--steer", "0:1=2"], "--swap-from and --steer are two analyses"),
        ("routes", ["--max-texts", "0"], "--max-texts must be a positive integer, got 0"),
        ("routes", ["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        ("embed", ["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        ("embed", ["--chunk-size", "0"], "--chunk-size must be >= 1, got 0"),
        ("embed", ["--merge-timeout", "-1"], "--merge-timeout must be a finite number >= 0, got -1.0"),
        ("embed", ["--shard-rank", "1"], "--shard-rank/--num-shards need --sharded"),
        ("embed", ["--address", "auto"], "--id-field/--address need --engine ray"),
        ("embed", ["--engine", "ray", "--sharded"], "--engine ray shards by itself"),
        ("embed", ["--sharded"], "with --sharded, --out is a directory, got e.npy"),
        ("embed", ["--merge", "d"], "--merge DIR takes no INPUT and no --sharded"),
        ("fit-reference", ["--max-texts", "0"], "--max-texts must be >= 1, got 0"),
        ("fit-reference", ["--batch-size", "-2"], "--batch-size must be >= 1, got -2"),
        ("search", ["-k", "0"], "-k must be >= 1, got 0"),
        ("search", ["--nlist", "0"], "--nlist must be >= 1, got 0"),
        ("search", ["--model", "m", "--server", "http://x"], "--model and --server exclude each other"),
        ("serve", ["--port", "70000"], "--port must be an integer in [0, 65535], got 70000"),
        ("serve", ["--max-batch-tokens", "0"], "max_batch_tokens (--max-batch-tokens) must be a positive"),
        ("serve", ["--batch-wait-ms", "nan"], "batch_wait_ms (--batch-wait-ms) must be a finite number"),
        ("evaluate", ["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        ("evaluate", ["--methods", ","], "--methods must name at least one of: hs, rw"),
        ("evaluate", ["--methods", "hs,mean"], "unknown method 'mean'"),
        ("evaluate", ["--prompts", ","], "--prompts must name at least one prompt"),
        ("upcycle", ["--router-std", "nan"], "--router-std must be a finite number >= 0, got nan"),
        ("upcycle", ["--top-k", "5"], "--top-k must be an int in [1, --experts=4], got 5"),
        ("upcycle", ["--min-count", "2"], "--min-count applies to --trim-vocab only"),
        ("upcycle", ["--layer-order", "0,x"], "--layer-order must be comma-separated integers"),
        ("upcycle", ["--router-option", "router_noisy=maybe"], "--router-option router_noisy="),
        ("simulate", ["--n", "40"], "--n must be an integer in [4, 16] (the supported range), got 40"),
        ("simulate", ["--steps", "0"], "--steps must be a positive integer, got 0"),
        ("simulate", ["--frame-every", "0"], "--frame-every must be a positive integer, got 0"),
        ("simulate", ["--seed", "-1"], "--seed must be an integer >= 0, got -1"),
        ("simulate", ["--blend", "1.5"], "--blend must be in [0, 1], got 1.5"),
        ("simulate", ["--jitter", "-0.1"], "--jitter must be a finite number >= 0, got -0.1"),
        ("train", ["--stop-at-step", "0"], "--stop-at-step must be a positive integer, got 0"),
    ],
)
def test_the_settings_check_every_value_once_naming_the_flag(command, argv, message):
    cls = _settings_class(command)
    parser = _subparsers()[command]
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        settings_of(cls, parser.parse_args([*CONVERTED[command][2], *argv]))


def test_lists_are_kept_as_tuples_and_the_settings_are_immutable():
    parser = _subparsers()["ablate"]
    cls = _settings_class("ablate")
    settings = settings_of(cls, parser.parse_args(["--corpus", "c", "--out", "o", "--layers", "0", "1"]))
    assert settings.layers == (0, 1) and isinstance(settings.load, LoadOptions)
    with pytest.raises(FrozenInstanceError):
        settings.layers = (2,)  # type: ignore[misc]


def test_upcycle_keywords_build_the_settings_the_flags_build():
    from moee.upcycle_settings import UpcycleSettings

    argv = ["dense", "--out", "o", "--experts", "4", "--top-k", "2", "--mode", "copy"]
    argv += ["--router", "hierarchical", "--router-option", "router_n_groups=2", "--no-router-balance"]
    flags = settings_of(UpcycleSettings, _subparsers()["upcycle"].parse_args(argv))
    keywords = UpcycleSettings.from_keywords(
        n_experts=4,
        top_k=2,
        mode="copy",
        router_type="hierarchical",
        router_options={"router_n_groups": 2},
        balance_router=False,
        out="o",
    )
    assert (
        flags.router_config
        == keywords.router_config
        == {
            "router_type": "hierarchical",
            "router_bias_gamma": 1e-3,
            "router_n_groups": 2,
        }
    )
    same = [f.name for f in fields(UpcycleSettings) if f.name != "router_option"]
    assert [getattr(flags, n) for n in same] == [getattr(keywords, n) for n in same]
    # a Python caller's errors name its keywords, the command line's the flags
    with pytest.raises(ValueError, match=r"^top_k must be an int in \[1, n_experts=4\], got 5$"):
        UpcycleSettings.from_keywords(n_experts=4, top_k=5)
