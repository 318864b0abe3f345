"""Balancing ablation: configs, summaries, the table next to Shazeer et al. (2017) Table 6, and a tiny real run."""

import json

import pytest

from moee.analysis.ablation import (
    SEED_TABLE6,
    TABLE6_WEIGHTS,
    ablation_config,
    ablation_markdown,
    plot_ablation,
    plot_training_curves,
    run_ablation,
    summarize_eval,
)

EVAL = {
    "loss": 2.0,
    "ppl": 7.389,
    "tokens": 100,
    "layers": [
        {"cv_importance": 0.2, "cv_load": 0.1, "max_over_mean_load": 1.5, "load": [1, 2]},
        {"cv_importance": 0.4, "cv_load": 0.3, "max_over_mean_load": 2.5, "load": [1, 3]},
    ],
}


def test_table6_rows_are_the_seeds():
    assert TABLE6_WEIGHTS == ((0.0, 0.0), (0.2, 0.0), (0.0, 0.2), (0.1, 0.1), (0.01, 0.01), (1.0, 1.0))
    assert SEED_TABLE6[(0.0, 0.0)]["max_over_mean_load"] == 17.80
    assert SEED_TABLE6[(0.1, 0.1)]["max_over_mean_load"] == 1.14  # the table, not "Innovation 2"'s 1.07


def test_ablation_config_only_changes_the_weights_and_dir():
    base = {"seed": 3, "model": {"hidden_size": 32}, "checkpoint": {"every": 10}}
    cfg = ablation_config(base, 0.2, 0.0, "/tmp/x")
    assert cfg["model"] == {
        "hidden_size": 32,
        "router_type": "noisy_top_k",
        "router_w_importance": 0.2,
        "router_w_load": 0.0,
    }
    assert cfg["checkpoint"] == {"every": 10, "dir": "/tmp/x"}
    assert base["model"] == {"hidden_size": 32}  # not mutated
    with pytest.raises(ValueError, match="noisy_top_k"):
        ablation_config({"model": {"router_type": "loss_free"}}, 0.1, 0.1, "/tmp/x")


def test_summarize_eval_averages_layers():
    row = summarize_eval(EVAL)
    assert row["cv_importance"] == pytest.approx(0.3)
    assert row["cv_load"] == pytest.approx(0.2)
    assert row["max_over_mean_load"] == pytest.approx(2.0)
    assert row["max_over_mean_load_worst_layer"] == pytest.approx(2.5)
    with pytest.raises(ValueError):
        summarize_eval({**EVAL, "layers": []})


def test_markdown_puts_seed_numbers_beside_ours(tmp_path):
    rows = [
        {"w_importance": 0.0, "w_load": 0.0, **summarize_eval(EVAL)},
        {"w_importance": 0.5, "w_load": 0.5, **summarize_eval(EVAL)},
    ]
    md = ablation_markdown(rows)
    assert "| 0 | 0 | 7.39 | 0.300 | 0.200 | 2.00 / 2.50 | - | - | 39.8 | 3.04 | 3.01 | 17.80 |" in md
    assert "| 0.5 | 0.5 |" in md and "- | - | - | -" in md
    plot_ablation(rows, tmp_path / "a.png")
    assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"


def test_bad_weights_raise(tmp_path):
    with pytest.raises(ValueError):
        run_ablation({}, tmp_path, weights=[(0.1, -1.0)])
    with pytest.raises(ValueError):
        run_ablation({}, tmp_path, weights=[])


@pytest.fixture
def tiny_setup(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = "the cat dog sat ran on a mat log hill river sang quiet old new".split()
    lines = [" ".join(words[(i * j) % len(words)] for j in range(30)) for i in range(1, 60)]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(lines, trainers.WordLevelTrainer(special_tokens=["<pad>", "<unk>", "<eos>"]))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>"
    )
    fast.save_pretrained(tmp_path / "tok")
    for name, part in (("train", lines[:50]), ("heldout", lines[50:])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
    base = {
        "seed": 0,
        "threads": 1,
        "model": {
            "hidden_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 8,
            "intermediate_size": 16,
        },  # fmt: skip
        "data": {
            "train": str(tmp_path / "train.jsonl"),
            "heldout": str(tmp_path / "heldout.jsonl"),
            "tokenizer": str(tmp_path / "tok"),
            "seq_len": 16,
            "cache_dir": str(tmp_path / "tokens"),
        },  # fmt: skip
        "optim": {"batch_size": 4},
        "schedule": {"max_steps": 3, "warmup_steps": 1},
        "eval": {"every": 3, "max_windows": 4, "batch_size": 4},
        "checkpoint": {"every": 3, "keep": 1},
    }
    return base, tmp_path


@pytest.mark.slow
def test_run_ablation_trains_each_row_and_reuses_results(tiny_setup, monkeypatch):
    base, tmp_path = tiny_setup
    rows = run_ablation(base, tmp_path / "abl", weights=[(0.0, 0.0), (1.0, 1.0)], progress=False)
    assert [(r["w_importance"], r["w_load"]) for r in rows] == [(0.0, 0.0), (1.0, 1.0)]
    for r in rows:
        assert r["steps"] == 3 and r["ppl"] > 1 and len(r["per_layer"]) == 1
        assert r["seed"] == SEED_TABLE6[(r["w_importance"], r["w_load"])]
        assert r["training"]["curve"]["step"] == [3]  # sampled every 10 steps plus the last
        assert set(r["training"]["last20"]) == {"lm_loss", "cv_load_mean", "max_over_mean_load_max"}
    assert "| 0 | 0 |" in ablation_markdown(rows)
    plot_training_curves(rows, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "abl" / "runs" / "wi1_wl1" / "result.json").is_file()

    def no_training(*args, **kwargs):
        raise AssertionError("a finished run must not be retrained")

    monkeypatch.setattr("moee.moe.trainer.train", no_training)
    again = run_ablation(base, tmp_path / "abl", weights=[(0.0, 0.0), (1.0, 1.0)], progress=False)
    assert again == rows
