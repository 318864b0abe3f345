"""--max-memory and --offload-folder: accelerate's memory budgets and disk offload as LoadOptions fields,
so every command that loads a model takes them. The flag is read once when the options are made (a
clear error naming it), both flags are refused without --device-map, and a tiny OLMoE loaded with a
CPU budget of half its size really has layers on disk and embeds exactly as when it is held in memory.
"""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from moee.capture.tiny import tiny_model, tiny_tokenizer
from moee.cli import build_parser, main
from moee.cli_options import load_from_args
from moee.loading import LoadOptions, parse_max_memory

TEXTS = ["the cat sat on the mat", "a dog ran under the big tree in the rain", "blue", "happy music at night"]


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("cpu=8GiB", {"cpu": 8 * 2**30}),
        ("0=20GiB,cpu=8GiB", {0: 20 * 2**30, "cpu": 8 * 2**30}),
        (" cuda:1 = 1.5GB , disk=100", {1: 1_500_000_000, "disk": 100}),
        ("mps=512mib", {"mps": 512 * 2**20}),
    ],
)
def test_max_memory_reads_accelerates_form(text, expected):
    assert parse_max_memory(text) == expected
    assert LoadOptions(device_map="auto", max_memory=text).max_memory == expected


def test_max_memory_mappings_are_read_the_same_way_and_reading_twice_changes_nothing():
    options = LoadOptions(device_map="auto", max_memory={"cpu": "8GiB", 0: 1000})
    assert options.max_memory == {"cpu": 8 * 2**30, 0: 1000}
    assert options.replace(dtype="bfloat16").max_memory == options.max_memory  # replace() reads it again
    assert options.hf_kwargs() == {"device_map": "auto", "max_memory": {"cpu": 8 * 2**30, 0: 1000}}
    assert options.hf_kwargs()["max_memory"] is not options.max_memory  # accelerate rewrites its copy


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("cpu", "cannot read 'cpu'"),
        ("cpu=", "cannot read 'cpu='"),
        ("gpu=8GiB", "unknown device 'gpu'"),
        ("cpu=8 gigs", "cannot read the size '8 gigs' of cpu"),
        ("cpu=8GiB,cpu=4GiB", "names device 'cpu' twice"),
        ("", "cannot read ''"),
        ({}, "is empty"),
        ({"cpu": -1}, "negative"),
        ({"cpu": 1.5}, "must be a number of bytes"),
        (["cpu=1GiB"], "must be a text or a mapping"),
    ],
)
def test_a_max_memory_that_cannot_be_read_is_named_with_its_form(value, message):
    with pytest.raises(ValueError, match=message) as caught:
        LoadOptions(device_map="auto", max_memory=value)
    assert "--max-memory" in str(caught.value)


def test_budgets_and_offload_folder_are_refused_without_a_device_map(tmp_path, capsys):
    for given, flag in (
        ({"max_memory": "cpu=1GiB"}, "--max-memory"),
        ({"offload_folder": "off"}, "--offload-folder"),
    ):
        with pytest.raises(ValueError, match=f"{flag} only applies with --device-map: add --device-map auto"):
            LoadOptions(**given)
    corpus = tmp_path / "t.txt"
    corpus.write_text("a cat\n", encoding="utf-8")
    assert main(["embed", str(corpus), "--out", str(tmp_path / "e.npy"), "--max-memory", "cpu=1GiB"]) == 2
    assert "moee embed: error: --max-memory only applies with --device-map" in capsys.readouterr().err
    afile = tmp_path / "file"
    afile.write_text("", encoding="utf-8")
    with pytest.raises(ValueError, match="--offload-folder .* is not a folder"):
        LoadOptions(device_map="auto", offload_folder=afile)
    assert LoadOptions(device_map="auto", offload_folder=tmp_path).offload_folder == str(tmp_path)


def test_every_command_that_loads_a_model_takes_the_flags():
    loading = [
        name for name, parser in _subparsers().items() if any(a.dest == "device_map" for a in parser._actions)
    ]
    assert {"embed", "search", "evaluate", "report", "routes", "ablate", "serve", "quickstart"} <= set(
        loading
    )
    given = {"--device-map": "auto", "--max-memory": "0=2GiB,cpu=1GiB", "--offload-folder": "off"}
    for name in loading:
        actions = _subparsers()[name]._actions
        args = argparse.Namespace(**{a.dest: a.default for a in actions})  # what the command reads
        for action in actions:
            for flag in set(action.option_strings) & set(given):
                setattr(args, action.dest, given[flag])
        options = LoadOptions.from_args(args)
        assert options.max_memory == {0: 2 * 2**30, "cpu": 2**30}, name
        assert options.offload_folder == "off", name


@pytest.fixture(scope="module")
def four_layer_dir(tmp_path_factory):
    """A tiny OLMoE with 4 MoE layers on disk, and its size in bytes."""
    path = tmp_path_factory.mktemp("tiny-olmoe-4")
    model = tiny_model("olmoe", n_layers=4)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path, sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.slow
def test_a_cpu_budget_offloads_layers_to_disk_and_the_vectors_stay_the_same(four_layer_dir, tmp_path):
    path, size = four_layer_dir
    corpus = tmp_path / "t.txt"
    corpus.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    flags = [
        "--device-map",
        "auto",
        "--max-memory",
        f"cpu={size // 2}",
        "--offload-folder",
        str(tmp_path / "off"),
    ]
    embed = ["embed", str(corpus), "--model", str(path)]

    # the options the command builds really put layers on disk, and capture sees through the offload hooks
    offloaded = load_from_args(
        _subparsers()["embed"].parse_args([str(corpus), "--out", "x.npy", "--model", str(path), *flags])
    )
    placements = offloaded.model.hf_device_map
    assert "disk" in placements.values() and "cpu" in placements.values(), placements
    assert any(p.device.type == "meta" for p in offloaded.model.parameters())  # held on disk between uses
    assert any((tmp_path / "off").iterdir())
    plain = load_from_args(
        _subparsers()["embed"].parse_args([str(corpus), "--out", "x.npy", "--model", str(path)])
    )
    for method in ("moee_sum", "rw", "hs"):
        np.testing.assert_allclose(
            offloaded.encode(TEXTS, method=method), plain.encode(TEXTS, method=method), atol=1e-6, rtol=0
        )

    # and end to end through `moee embed`
    assert main([*embed, "--out", str(tmp_path / "plain.npy")]) == 0
    assert main([*embed, "--out", str(tmp_path / "offloaded.npy"), *flags]) == 0
    np.testing.assert_allclose(
        np.load(tmp_path / "offloaded.npy"), np.load(tmp_path / "plain.npy"), atol=1e-6, rtol=0
    )


def test_layers_placed_on_disk_without_a_folder_name_the_flag(four_layer_dir, tmp_path, capsys):
    path, size = four_layer_dir
    corpus = tmp_path / "t.txt"
    corpus.write_text("a cat\n", encoding="utf-8")
    argv = ["embed", str(corpus), "--model", str(path), "--out", str(tmp_path / "e.npy")]
    assert main([*argv, "--device-map", "auto", "--max-memory", f"cpu={size // 2}"]) == 2
    err = capsys.readouterr().err
    assert "some layers on disk" in err and "add --offload-folder DIR" in err, err
