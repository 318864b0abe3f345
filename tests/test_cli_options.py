"""The CLI's embedding and loading flags come from the EmbeddingConfig and LoadOptions fields
(moee/cli_options.py): every field is a flag of every command that takes it, flags round-trip into
the configuration, a flag left out is absent (the model's configuration applies), and a new field
with metadata becomes a flag everywhere without touching a command."""

from __future__ import annotations

import argparse
from dataclasses import field, fields, make_dataclass

import pytest

import moee.cli_options as cli_options
from moee.cli import build_parser
from moee.cli_options import add_field_arguments, explicit_config
from moee.embed.config import PAPER_FIELDS, EmbeddingConfig
from moee.embed.settings import FIT_REFERENCE_NOT_FLAGS
from moee.evaluation.settings import EVAL_NOT_FLAGS
from moee.loading import LoadOptions

#: The commands that embed with a configuration of their own flags, and the fields each takes otherwise.
EMBEDDING_COMMANDS = {"embed": {}, "fit-reference": FIT_REFERENCE_NOT_FLAGS, "evaluate": EVAL_NOT_FLAGS}
LOADING_COMMANDS = ("embed", "search", "evaluate", "fit-reference", "report", "quickstart")


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _dests(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions}


def test_every_configuration_field_is_a_flag_of_every_embedding_command():
    parsers = _subparsers()
    names = [f.name for f in fields(EmbeddingConfig)]
    for command, not_flags in EMBEDDING_COMMANDS.items():
        dests = _dests(parsers[command])
        assert set(not_flags) <= set(names)  # exclusions name real fields, each with its reason
        assert all(isinstance(why, str) and why for why in not_flags.values())
        for name in names:
            if name in not_flags:
                assert name not in dests, (command, name)
                continue
            action = dests[name]
            assert action.default is argparse.SUPPRESS, (command, name)  # absent unless given
            assert "(default: the model's saved configuration, else " in action.help, (command, name)
        assert "paper" in dests
    # search embeds its queries with the configuration its corpus sidecar records: no flags
    assert not set(names) & set(_dests(parsers["search"]))


def test_help_says_where_a_default_comes_from(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["embed", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: last)" not in text
    assert "token pooling (default: the model's saved configuration, else last)" in text
    assert "--device DEVICE e.g. cpu, cuda, cuda:1 (default: cuda if available)" in text


def _embed_args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["embed", "in.txt", "--out", "x.npy", *flags])


def test_flags_round_trip_into_the_configuration(tmp_path):
    assert explicit_config(_embed_args()) == {}  # nothing given: every field is the model's
    ref = tmp_path / "ref.safetensors"
    args = _embed_args(
        "--method", "rw", "--pooling", "mean", "--prompt", "prompteol,meaning", "--score", "softmax",
        "--alpha", "0.5", "--no-normalize", "--recipe", "echo", "--hs-layer", "1:3", "--rw-layers", "0:1,2:0.5",
        "--reference", str(ref),
    )  # fmt: skip
    given = explicit_config(args)
    assert set(given) == {f.name for f in fields(EmbeddingConfig)}
    assert EmbeddingConfig(**given) == EmbeddingConfig(
        method="rw",
        pooling="mean",
        prompt=("prompteol", "meaning"),
        score="softmax",
        alpha=0.5,
        normalize=False,
        recipe="echo",
        hs_layer=(1, 3),
        rw_layers={0: 1.0, 2: 0.5},
        reference=str(ref.resolve()),
    )
    assert explicit_config(_embed_args("--prompt", "none", "--recipe", "none", "--normalize")) == {
        "prompt": None,
        "recipe": None,
        "normalize": True,
    }
    assert explicit_config(_embed_args("--paper", "--pooling", "mean")) == {**PAPER_FIELDS, "pooling": "mean"}
    with pytest.raises(SystemExit):
        _embed_args("--pooling", "max")


def test_a_new_configuration_field_becomes_a_flag_of_every_embedding_command(monkeypatch):
    extended = make_dataclass(
        "ExtendedConfig",
        [("new_option", int, field(default=3, metadata={"help": "a new option", "type": int}))],
        bases=(EmbeddingConfig,),
        frozen=True,
    )
    monkeypatch.setattr(cli_options, "EmbeddingConfig", extended)
    parsers = _subparsers()
    for command in EMBEDDING_COMMANDS:
        action = _dests(parsers[command])["new_option"]
        assert action.option_strings == ["--new-option"]
        assert action.help == "a new option (default: the model's saved configuration, else 3)"
    assert explicit_config(_embed_args("--new-option", "7")) == {"new_option": 7}


def test_loading_flags_come_from_the_load_options_fields():
    parsers = _subparsers()
    for command in LOADING_COMMANDS:
        dests = _dests(parsers[command])
        for f in fields(LoadOptions):
            assert f.name in dests, (command, f.name)
            assert dests[f.name].help.startswith(f.metadata["help"])
    assert _dests(parsers["embed"])["allow_pickle_weights"].option_strings == ["--allow-bin"]
    args = _embed_args("--dtype", "bfloat16", "--device-map", "auto", "--trust-remote-code", "--allow-bin")
    assert LoadOptions.from_args(args) == LoadOptions(
        dtype="bfloat16", device_map="auto", trust_remote_code=True, allow_pickle_weights=True
    )
    assert LoadOptions.from_args(_embed_args()) == LoadOptions()


def test_flag_metadata_with_a_typo_is_an_error():
    bad = make_dataclass("Bad", [("x", int, field(default=1, metadata={"help": "x", "choise": (1, 2)}))])
    with pytest.raises(TypeError, match="Bad.x: flag metadata"):
        add_field_arguments(argparse.ArgumentParser(), bad, explicit=True)
    undocumented = make_dataclass("Undocumented", [("x", int, field(default=1))])
    with pytest.raises(TypeError, match="needs 'help'"):
        add_field_arguments(argparse.ArgumentParser(), undocumented, explicit=False)


@pytest.mark.parametrize("command", ["embed", "fit-reference"])  # evaluate takes --prompts
def test_prompt_lists_have_an_unambiguous_form_and_ambiguous_input_is_refused(command, capsys):
    parser = _subparsers()[command]

    def prompt(*values):
        return explicit_config(parser.parse_args([*_required(command), *values]))["prompt"]

    ensemble = ("prompteol", "Q: {text}")
    assert prompt("--prompt", "prompteol", "--prompt", "Q: {text}") == ensemble  # repeated
    assert prompt("--prompt", '["prompteol", "Q: {text}"]') == ensemble  # a JSON list
    assert prompt("--prompt", '["a, {text}"]') == "a, {text}"  # one template with a comma
    assert (
        prompt("--prompt", "Summarize, briefly: {text}") == "Summarize, briefly: {text}"
    )  # no reading as a list
    assert prompt("--prompt", "prompteol,meaning") == ("prompteol", "meaning")  # names
    assert EmbeddingConfig(prompt=prompt("--prompt", "prompteol", "--prompt", "Q: {text}")).is_ensemble
    for bad, message in (
        (["--prompt", "prompteol,Q: {text}"], "is ambiguous: one template with a comma, or an ensemble of 2"),
        (["--prompt", "Q: {text}, A: {text}"], "is ambiguous"),
        (["--prompt", "[{text}]"], "looks like a JSON list"),
        (["--prompt", "none", "--prompt", "prompteol"], "none cannot be combined"),
    ):
        with pytest.raises(SystemExit):
            parser.parse_args([*_required(command), *bad])
        assert message in capsys.readouterr().err


def _required(command: str) -> list[str]:
    return {"embed": ["c.txt", "--out", "e.npy"], "fit-reference": ["c.txt", "--out", "r"]}.get(command, [])
