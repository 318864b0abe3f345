"""What `moee upcycle` writes: inputs checked before any loading, an existing output refused or
replaced whole, a staged folder committed by rename, umask file modes, loadable depth up-scaling."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch
from test_moe_upcycle import IDS, dense_model, max_diff, outputs
from transformers import AutoModelForCausalLM

import moee.moe.upcycle as upcycle_mod
from moee.capture.tiny import tiny_tokenizer
from moee.cli import main
from moee.moe.upcycle import save_upcycled, upcycle


@pytest.fixture
def dense_dir(tmp_path):
    dense = dense_model("llama")
    dense.save_pretrained(tmp_path / "dense")
    tiny_tokenizer().save_pretrained(tmp_path / "dense")
    return tmp_path / "dense"


def _argv(src, out, *extra):
    return ["upcycle", str(src), "--out", str(out), "--experts", "4", "--top-k", "2", *extra]


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if the dense model is loaded: the checks must come first."""

    def refuse(*args, **kwargs):
        raise AssertionError("the dense model was loaded before the inputs were checked")

    monkeypatch.setattr(upcycle_mod, "_load_dense", refuse)


def test_a_file_as_out_is_refused_even_with_overwrite(dense_dir, tmp_path, capsys, no_loading):
    target = tmp_path / "model.bin"
    target.write_bytes(b"not a folder")
    assert main(_argv(dense_dir, target, "--overwrite")) == 2
    captured = capsys.readouterr()
    assert "is a file, not a folder" in captured.err and "wrote" not in captured.out
    assert target.read_bytes() == b"not a folder"


@pytest.mark.slow
def test_overwrite_replaces_the_whole_folder_without_a_stale_tokenizer(dense_dir, tmp_path, capsys):
    """The previous model's files go, its tokenizer included; a user's own files stay."""
    out = tmp_path / "moe"
    assert main(_argv(dense_dir, out)) == 0
    assert (out / "tokenizer.json").is_file()
    bare = tmp_path / "bare"  # the same weights, no tokenizer
    dense_model("llama").save_pretrained(bare)
    (out / "notes.txt").write_text("left by hand")
    assert main(_argv(bare, out, "--overwrite", "--mode", "copy")) == 0
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "notes.txt",
    ]
    assert (out / "notes.txt").read_text() == "left by hand"
    assert json.loads((out / "config.json").read_text())["upcycle_mode"] == "copy"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".moe.")]  # no staging or old folder left


@pytest.mark.parametrize("value", ["nan", "inf", "-0.5"])
def test_a_bad_router_std_is_refused_before_loading(dense_dir, tmp_path, capsys, no_loading, value):
    assert main(_argv(dense_dir, tmp_path / "moe", "--mode", "copy", f"--router-std={value}")) == 2
    assert "--router-std must be a finite number >= 0" in capsys.readouterr().err
    assert not (tmp_path / "moe").exists()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0])
def test_upcycle_refuses_a_non_finite_or_negative_router_std(value):
    with pytest.raises(ValueError, match="router_std must be a finite number >= 0"):
        upcycle(dense_model("llama"), n_experts=2, top_k=1, mode="copy", router_std=value)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "--trim-vocab corpus not found"),
        ("", "holds no texts"),
        ('{"text": "the river"}\n{"body": "no text field"}\n', ":2: needs a string 'text' field"),
        ('{"text": "the river"}\nnot json\n', ":2: invalid JSON"),
    ],
)
def test_trim_vocab_and_the_numbers_are_checked_before_loading(
    dense_dir, tmp_path, capsys, no_loading, content, message
):
    corpus = tmp_path / "corpus.jsonl"
    if content is not None:
        corpus.write_text(content)
    assert main(_argv(dense_dir, tmp_path / "moe", "--trim-vocab", str(corpus))) == 2
    assert message in capsys.readouterr().err
    assert main(_argv(dense_dir, tmp_path / "moe", "--layer-order", "0,-1")) == 2
    assert "--layer-order takes layer indices >= 0" in capsys.readouterr().err
    for empty in ("", " "):  # an empty order is refused, not read as "no reordering"
        assert main(_argv(dense_dir, tmp_path / "moe", "--layer-order", empty)) == 2
        assert "--layer-order is empty" in capsys.readouterr().err
    assert main(_argv(dense_dir, tmp_path / "moe", "--min-count", "0")) == 2
    assert "--min-count must be >= 1" in capsys.readouterr().err


def test_a_layer_order_beyond_the_layers_is_refused_before_the_weights_load(dense_dir, monkeypatch):
    from transformers import AutoModelForCausalLM as Auto

    def refuse(*args, **kwargs):
        raise AssertionError("weights loaded")

    monkeypatch.setattr(Auto, "from_pretrained", refuse)
    with pytest.raises(ValueError, match=r"layer indices in \[0, 2\), got \[0, 1, 2\]"):
        upcycle(dense_dir, n_experts=2, top_k=1, layer_order=[0, 1, 2])


@pytest.mark.slow
def test_a_save_killed_midway_leaves_nothing_that_looks_finished(tmp_path, monkeypatch):
    model = upcycle(dense_model("llama"), n_experts=2, top_k=1)
    tokenizer = tiny_tokenizer()

    def killed(*args, **kwargs):  # the weights are written, the tokenizer never is
        raise KeyboardInterrupt

    monkeypatch.setattr(type(tokenizer), "save_pretrained", killed)
    with pytest.raises(KeyboardInterrupt):
        save_upcycled(model, tmp_path / "moe", tokenizer=tokenizer)
    assert list(tmp_path.iterdir()) == []  # no --out, and the staging folder is gone
    monkeypatch.undo()
    save_upcycled(model, tmp_path / "moe", tokenizer=tokenizer)
    before = sorted(p.name for p in (tmp_path / "moe").iterdir())
    monkeypatch.setattr(type(tokenizer), "save_pretrained", killed)
    with pytest.raises(KeyboardInterrupt):
        save_upcycled(model, tmp_path / "moe", tokenizer=tokenizer, overwrite=True)
    assert sorted(p.name for p in (tmp_path / "moe").iterdir()) == before  # the old model, whole
    assert [p.name for p in tmp_path.iterdir()] == ["moe"]
    with pytest.raises(FileExistsError, match="pass --overwrite"):
        save_upcycled(model, tmp_path / "moe")


def test_a_kill_leaves_only_a_hidden_staging_folder(tmp_path, monkeypatch):
    """A hard kill cannot run cleanup: what it leaves is the hidden staging folder, never --out."""
    import moee.io

    model = upcycle(dense_model("llama"), n_experts=2, top_k=1)

    def killed(staging, target, output):  # a kill after every file is written, before the commit
        raise SystemExit(9)

    monkeypatch.setattr(moee.io, "commit_folder", killed)
    with pytest.raises(SystemExit):
        save_upcycled(model, tmp_path / "moe")
    left = [p.name for p in tmp_path.iterdir()]
    assert not (tmp_path / "moe").exists() and len(left) == 1 and left[0].startswith(".moe.tmp-")
    assert (tmp_path / left[0] / "model.safetensors").is_file()


def test_weights_are_written_with_the_umask_modes(tmp_path):
    old = os.umask(0o027)
    try:
        save_upcycled(upcycle(dense_model("llama"), n_experts=2, top_k=1), tmp_path / "moe")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "moe").stat().st_mode) == 0o750
    for name in ("model.safetensors", "config.json"):
        assert stat.S_IMODE((tmp_path / "moe" / name).stat().st_mode) == 0o640, name


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_layer_order_on_qwen_writes_a_model_that_loads(family, tmp_path):
    dense = dense_model(
        family, layer_types=["full_attention", "sliding_attention"], sliding_window=4, use_sliding_window=True
    )
    moe = upcycle(dense, n_experts=4, top_k=4, layer_order=[0, 1, 1, 0])
    save_upcycled(moe, tmp_path / "moe")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "moe").eval()
    text = loaded.config.text_config
    assert text.num_hidden_layers == 4
    assert text.layer_types == ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    assert max_diff(outputs(loaded, IDS), outputs(moe, IDS)) <= 1e-5
    assert torch.isfinite(outputs(loaded, IDS)).all()
