"""The training configuration is one frozen ``TrainingConfig`` (``moee.train_settings``): it reads
every config file and every config a checkpoint saved to the dict the trainer saves (a saved
config stays byte for byte what it was, so runs resume across the change), refuses an unknown
key naming it and its section, and checks every value once, naming the key."""

from __future__ import annotations

import copy
import json
import pickle
import re
from dataclasses import FrozenInstanceError
from pathlib import Path

import pytest
import test_moe_trainer
from test_moe_trainer import tiny_cfg

from moee.moe.checkpoint import latest_checkpoint, read_state
from moee.moe.trainer import load_config, train
from moee.train_settings import COMMENT_KEY, TrainingConfig

ROOT = Path(__file__).resolve().parents[1]
corpus = test_moe_trainer.corpus  # the tiny corpus fixture

#: every config the repository ships: the configs, the bundled model's copy, the ablation's base
CONFIG_FILES = [
    *sorted((ROOT / "configs").glob("*.json")),
    ROOT / "moee" / "assets" / "default-model" / "training_config.json",
    ROOT / "analysis" / "ablation" / "base_config.json",
]

#: what the trainer saved into its checkpoints for configs/smollm2_moe.json before the settings
#: were a dataclass (its trainer_state.json "config", read back from a run's checkpoints)
SMOLLM2_SAVED = {
    "seed": 0,
    "threads": 1,
    "model": {},
    "init": {"from": "build/upcycled-smollm2"},
    "data": {
        "train": "build/corpus/train.jsonl",
        "heldout": "build/corpus/heldout.jsonl",
        "tokenizer": "build/upcycled-smollm2",
        "seq_len": 256,
        "cache_dir": "build/tokens",
    },
    "optim": {
        "lr": 0.0005,
        "betas": [0.9, 0.98],
        "eps": 1e-08,
        "weight_decay": 0.0,
        "grad_clip": 1.0,
        "batch_size": 8,
        "router_lr_scale": 0.2,
        "trainable": "routed",
    },
    "schedule": {"max_steps": 1200, "warmup_steps": 30, "min_lr_ratio": 0.1, "time_budget_minutes": None},
    "eval": {"every": 25, "max_windows": 32, "batch_size": 8},
    "checkpoint": {"dir": "build/train_smollm2", "every": 25, "keep": 3},
    "stop_after_minutes": None,
}


def _filled(raw: dict) -> dict:
    """``raw`` with every key it leaves out at its default (sections merged key by key), in the
    documented order, without its comment: what the trainer saves."""
    defaults = TrainingConfig.default_dict()
    out = {}
    for key, default in defaults.items():
        given = raw.get(key, default)
        out[key] = {**default, **given} if isinstance(default, dict) and key != "model" else given
    return out


def _round_trips(saved: dict) -> None:
    config = TrainingConfig.from_dict(saved)
    assert config.to_dict() == saved
    assert json.dumps(config.to_dict(), indent=2) == json.dumps(saved, indent=2)  # same bytes, same order
    assert TrainingConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_config_reads_to_the_dict_the_trainer_saves_and_round_trips(path):
    raw = json.loads(path.read_text())
    config = TrainingConfig.from_json(path)
    saved = config.to_dict()
    assert COMMENT_KEY not in saved and list(saved) == TrainingConfig.keys()
    assert saved == _filled(raw) == load_config(path)
    _round_trips(saved)


def test_the_running_default_models_saved_config_reads_back_unchanged():
    assert TrainingConfig.from_json(ROOT / "configs" / "smollm2_moe.json").to_dict() == SMOLLM2_SAVED
    _round_trips(SMOLLM2_SAVED)


def test_a_config_saved_by_a_training_run_round_trips_and_older_ones_still_read(corpus, tmp_path):
    cfg = tiny_cfg(corpus, tmp_path / "run")
    cfg["optim"]["betas"] = (0.9, 0.95)  # a tuple from Python: saved as the JSON list
    train(cfg, stop_at_step=2, progress=False)
    saved = read_state(latest_checkpoint(tmp_path / "run"))["config"]
    assert saved == _filled(json.loads(json.dumps(cfg)))
    _round_trips(saved)
    # a checkpoint of an older trainer, saved before init and optim.trainable existed
    older = copy.deepcopy(saved)
    del older["init"], older["optim"]["trainable"]
    assert TrainingConfig.from_dict(older).to_dict() == saved


def test_paths_given_as_path_objects_are_saved_as_strings(corpus, tmp_path):
    """A ``Path`` in a Python config crashed the first checkpoint (JSON cannot hold it)."""
    cfg = tiny_cfg(corpus, tmp_path / "run")
    cfg["data"]["train"] = corpus["root"] / "train.jsonl"
    cfg["checkpoint"]["dir"] = tmp_path / "run"
    saved = load_config(cfg)
    assert saved["data"]["train"] == str(corpus["root"] / "train.jsonl")
    assert saved["checkpoint"]["dir"] == str(tmp_path / "run")
    json.dumps(saved)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"optimizer": {}}, "config: unknown section(s) ['optimizer']; expected ["),
        (
            {"optim": {"learning_rate": 1.0}},
            "config: unknown key(s) ['learning_rate'] in 'optim'; expected [",
        ),
        ({"init": {"form": "x"}}, "config: unknown key(s) ['form'] in 'init'; expected ['from']"),
        ({"eval": [1]}, "config: section 'eval' must be an object"),
        ({"model": {"hiden_size": 8}}, "config: unknown key(s) ['hiden_size'] in 'model'"),
    ],
)
def test_an_unknown_key_is_refused_naming_it_and_its_section(corpus, tmp_path, change, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        load_config({**tiny_cfg(corpus, tmp_path), **change})


@pytest.mark.parametrize(
    ("section", "key", "value", "message"),
    [
        ("optim", "lr", 0, "optim.lr must be > 0, got 0"),
        ("optim", "betas", [0.9], "optim.betas must be two numbers in [0, 1), got [0.9]"),
        ("optim", "eps", -1e-8, "optim.eps must be >= 0, got -1e-08"),
        ("optim", "weight_decay", -0.1, "optim.weight_decay must be >= 0, got -0.1"),
        ("optim", "grad_clip", 0, "optim.grad_clip must be > 0 (the largest gradient norm), got 0"),
        ("optim", "router_lr_scale", float("nan"), "optim.router_lr_scale must be >= 0, got nan"),
        ("optim", "batch_size", 0, "optim.batch_size must be a positive integer, got 0"),
        ("optim", "trainable", "experts", "optim.trainable must be one of ('all', 'routed'), got 'experts'"),
        ("data", "train", None, "data.train is required"),
        ("data", "heldout", 5, "data.heldout must be a path (a string) or null, got 5"),
        ("data", "seq_len", 2.5, "data.seq_len must be a positive integer, got 2.5"),
        ("schedule", "max_steps", 0, "schedule.max_steps must be a positive integer, got 0"),
        ("schedule", "warmup_steps", -1, "schedule.warmup_steps must be an integer >= 0, got -1"),
        ("schedule", "min_lr_ratio", 1.5, "schedule.min_lr_ratio must be in [0, 1], got 1.5"),
        (
            "schedule",
            "time_budget_minutes",
            -5,
            "schedule.time_budget_minutes must be a finite number >= 0 or null, got -5",
        ),
        ("eval", "every", 0, "eval.every must be a positive integer, got 0"),
        ("eval", "max_windows", -1, "eval.max_windows must be an integer >= 0 or null, got -1"),
        ("eval", "batch_size", 0, "eval.batch_size must be a positive integer, got 0"),
        ("checkpoint", "dir", None, "checkpoint.dir must be a path (a string), got None"),
        ("checkpoint", "every", 0, "checkpoint.every must be a positive integer, got 0"),
        ("checkpoint", "keep", -1, "checkpoint.keep must be an integer >= 0 or null, got -1"),
        (None, "seed", -1, "seed must be an integer >= 0, got -1"),
        (None, "threads", "2", "threads must be an integer >= 0 or null, got '2'"),
        (
            None,
            "stop_after_minutes",
            True,
            "stop_after_minutes must be a finite number >= 0 or null, got True",
        ),
    ],
)
def test_every_value_is_checked_once_naming_its_key(corpus, tmp_path, section, key, value, message):
    cfg = tiny_cfg(corpus, tmp_path)
    (cfg.setdefault(section, {}) if section else cfg)[key] = value
    with pytest.raises(ValueError, match="^" + re.escape(f"config: {message}") + "$"):
        load_config(cfg)


def test_a_bad_value_stops_moee_train_before_any_work_naming_the_file_and_key(corpus, tmp_path, capsys):
    """eval.every 0 was accepted and the run died of a ZeroDivisionError after its first step."""
    from moee.cli import main

    cfg = tiny_cfg(corpus, tmp_path / "run")
    cfg["eval"]["every"] = 0
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    assert main(["train", "--config", str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err == f"moee train: error: {path}: eval.every must be a positive integer, got 0\n"
    assert not (tmp_path / "run").exists()


def test_the_config_is_immutable_and_copies_as_itself(corpus, tmp_path):
    config = TrainingConfig.from_dict(tiny_cfg(corpus, tmp_path))
    with pytest.raises(FrozenInstanceError):
        config.seed = 1  # type: ignore[misc]
    with pytest.raises(FrozenInstanceError):
        config.optim.lr = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.model["hidden_size"] = 32  # type: ignore[index]
    assert copy.deepcopy(config) == config == pickle.loads(pickle.dumps(config))
    assert config.optim.betas == (0.9, 0.95) and config.init.from_ is None
