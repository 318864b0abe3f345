"""Trainer: every input checked before work starts, and the load figures of training and
evaluation (the same noise-free statistic, beside its ceiling, with a collapse warning)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import test_moe_trainer
from test_moe_trainer import tiny_cfg

from moee.moe.trainer import train

os.environ.setdefault("HF_HUB_OFFLINE", "1")

corpus = test_moe_trainer.corpus  # the tiny corpus fixture


@pytest.mark.slow
def test_missing_inputs_of_the_default_config_name_the_scripts_that_build_them(tmp_path, monkeypatch, capsys):
    """A clone without build/: every missing input is named, with its producer, before any loading."""
    from moee.cli import main

    config = Path(__file__).resolve().parents[1] / "configs" / "default_model.json"
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--config", str(config), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "init.from build/upcycled-minilm (built by scripts/train_default_model.sh" in err
    assert "data.train build/corpus/train.jsonl (built by scripts/build_corpus.py)" in err
    assert "data.heldout build/corpus/heldout.jsonl" in err and "data.tokenizer build/upcycled-minilm" in err
    assert len(err.splitlines()) == 1  # no traceback


def test_a_missing_corpus_is_reported_before_the_tokenizer_loads(corpus, tmp_path, monkeypatch):
    import transformers

    def no_loading(*_args, **_kwargs):
        raise AssertionError("the tokenizer must not load before the inputs are checked")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_loading)
    cfg = tiny_cfg(corpus, tmp_path / "run")
    cfg["data"]["heldout"] = str(tmp_path / "nowhere.jsonl")
    with pytest.raises(FileNotFoundError, match=r"data\.heldout .*nowhere\.jsonl"):
        train(cfg, progress=False)


def test_training_logs_the_noise_free_load_that_evaluation_reports_and_warns_of_collapse(
    corpus, tmp_path, capsys
):
    """A noisy gate whose clean logits are all zero (init, router lr 0): training-mode noise spreads
    the picks, yet every token would take the same two experts in evaluation. The train records
    must show that collapse (max/mean at its ceiling 4 / 2, two dead experts per layer) as the
    held-out evaluation does, and the evaluation warns."""
    from moee.cli import main

    cfg = tiny_cfg(corpus, tmp_path / "run")
    cfg["model"].update(router_type="noisy_top_k", router_noisy=True)
    cfg["optim"]["router_lr_scale"] = 0.0
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    assert main(["train", "--config", str(path), "--no-progress"]) == 0
    captured = capsys.readouterr()
    err = captured.err
    assert "max/mean 2.00 of ceiling 2.00, dead experts 4" in captured.out + err
    assert "warning: held-out evaluation at step 3: routing collapse in 2 of 2 layers" in err
    records = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    train_records = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert all(r["max_over_mean_load_max"] == 2.0 and r["dead_experts"] == 4 for r in train_records)
    assert all(
        layer["max_over_mean_load"] == 2.0 and layer["dead"] == 2 for r in evals for layer in r["layers"]
    )


def test_collapse_warning_names_the_layers_and_the_ceiling():
    from moee.moe.trainer import collapse_warning

    layers = [
        {"max_over_mean_load": 1.2, "dead": 0},
        {"max_over_mean_load": 2.5, "dead": 0},
        {"max_over_mean_load": 1.5, "dead": 1},
    ]
    message = collapse_warning("eval", layers, 4.0)
    assert "2 of 3 layers" in message and "layer 1: max/mean 2.50" in message and "layer 2" in message
    assert "layer 0" not in message and "ceiling 4.00" in message
    assert "raise the gate's balancing-loss weights" in message and "moee upcycle --router" in message
    loss_free = collapse_warning("eval", layers, 4.0, "loss_free")
    assert loss_free.startswith(message.split(": raise")[0]) and loss_free.endswith("raise router_bias_gamma")
    assert collapse_warning("eval", layers[:1], 4.0) is None
    assert collapse_warning("eval", [{"max_over_mean_load": 2.0, "dead": 0}], 4.0) is None
