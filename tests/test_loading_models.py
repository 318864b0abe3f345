"""One loader, one registration: every moee model type loads through the Auto classes after
``import moee``; training checkpoints load wherever a model does (the run's tokenizer, or
``--tokenizer``), with errors that name what is missing; ``moee report --checkpoints`` takes
DeepSeekMoE v1 checkpoints."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_moe_trainer import corpus, tiny_cfg  # noqa: F401  (corpus is a fixture)
from test_moe_upcycle import dense_model

from moee.capture.tiny import TINY_WORDS, tiny_model, tiny_tokenizer
from moee.cli import main
from moee.cli_options import add_loading_arguments
from moee.embed.embedder import MoEEmbedder
from moee.loading import LoadOptions, load_model, split_revision, tokenizer_source

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    """A saved model of every type moee defines: moee_lm, deepseek, and a ``moee upcycle`` output."""
    root = tmp_path_factory.mktemp("models")
    dirs = {}
    for model_type in ("moee_lm", "deepseek"):
        dirs[model_type] = root / model_type
        tiny_model(model_type, n_layers=2).save_pretrained(dirs[model_type])
    dense_model("llama").save_pretrained(root / "dense")
    tiny_tokenizer().save_pretrained(root / "dense")
    up = ["upcycle", str(root / "dense"), "--out", str(root / "up"), "--experts", "4", "--top-k", "2"]
    assert main(up) == 0
    dirs["moee_upcycled"] = root / "up"
    return dirs


def _python(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_import_moee_registers_every_model_type_with_the_auto_classes(model_dirs):
    paths = {k: str(v) for k, v in model_dirs.items()}
    check = (
        "from transformers import AutoConfig, AutoModelForCausalLM\n"
        f"for kind, path in {paths!r}.items():\n"
        "    config = AutoConfig.from_pretrained(path)\n"
        "    model = AutoModelForCausalLM.from_pretrained(path)\n"
        "    print(kind, config.model_type, type(model).__name__)\n"
    )
    expected = {
        "moee_lm moee_lm MoEEForCausalLM",
        "deepseek deepseek DeepseekV1ForCausalLM",
        "moee_upcycled moee_upcycled MoEEUpcycledForCausalLM",
    }
    # import moee first: light (no torch, no transformers), registered when transformers loads
    light = (
        "import sys\nimport moee\nassert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
    )
    assert set(_python(light + check).splitlines()) == expected
    # transformers first: registered by import moee itself
    assert set(_python("import transformers.models.auto\nimport moee\n" + check).splitlines()) == expected


def test_register_models_covers_every_moee_model_type():
    from transformers import AutoConfig

    from moee.models import MODEL_TYPES, register_models

    register_models()
    assert set(MODEL_TYPES) == {"moee_lm", "moee_upcycled", "deepseek"}
    for model_type in MODEL_TYPES:
        assert AutoConfig.for_model(model_type).model_type == model_type


# ------------------------------------------------------------------ training checkpoints


@pytest.fixture(scope="module")
def run(corpus, tmp_path_factory) -> dict:  # noqa: F811
    from moee.moe.trainer import train

    out = tmp_path_factory.mktemp("run")
    result = train(tiny_cfg(corpus, out / "ckpt"), progress=False)
    texts = out / "texts.txt"
    texts.write_text("the king spoke to the river\nthe river answered\nold stones\n")
    return {"checkpoint": result.checkpoint, "tokenizer": corpus["root"] / "tok", "texts": texts}


def test_a_training_checkpoint_loads_with_the_tokenizer_of_its_run(run, tmp_path):
    ckpt = run["checkpoint"]
    assert ckpt.name.startswith("step_") and not (ckpt / "tokenizer.json").exists()
    assert tokenizer_source(ckpt) == (str(run["tokenizer"]), "run")
    emb = MoEEmbedder.from_pretrained(ckpt, device="cpu")
    assert emb.tokenizer.name_or_path == str(run["tokenizer"])
    assert load_model(ckpt, LoadOptions(device="cpu")).tokenizer_source == str(run["tokenizer"])
    vectors = emb.encode(["the river answered"], method="hs")
    assert vectors.shape == (1, emb.hidden_size) and np.isfinite(vectors).all()
    out = tmp_path / "x.npy"
    assert main(["embed", str(run["texts"]), "--model", str(ckpt), "--out", str(out), "--device", "cpu"]) == 0
    assert np.load(out).shape[0] == 3


def test_a_model_without_a_tokenizer_says_what_is_missing_and_takes_tokenizer(run, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(run["checkpoint"] / name, bare / name)
    with pytest.raises(FileNotFoundError, match=r"no tokenizer for model .*bare.*pass --tokenizer"):
        MoEEmbedder.from_pretrained(bare, device="cpu")
    out = tmp_path / "x.npy"
    argv = ["embed", str(run["texts"]), "--model", str(bare), "--out", str(out), "--device", "cpu"]
    assert main(argv) == 2
    assert "pass --tokenizer" in capsys.readouterr().err
    assert main(argv + ["--tokenizer", str(run["tokenizer"])]) == 0
    emb = MoEEmbedder.from_pretrained(bare, LoadOptions(device="cpu", tokenizer=str(run["tokenizer"])))
    assert emb.tokenizer.name_or_path == str(run["tokenizer"])

    moved = tmp_path / "moved"
    shutil.copytree(run["checkpoint"], moved)
    state = json.loads((moved / "trainer_state.json").read_text())
    state["config"]["data"]["tokenizer"] = str(tmp_path / "gone" / "tok")
    (moved / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(FileNotFoundError, match=r"trained with the tokenizer '.*gone/tok'.*pass --tokenizer"):
        MoEEmbedder.from_pretrained(moved, device="cpu")


def test_the_tokenizer_option_has_its_flag():
    parser = argparse.ArgumentParser()
    add_loading_arguments(parser)
    assert LoadOptions.from_args(parser.parse_args(["--tokenizer", "some/tok"])).tokenizer == "some/tok"
    assert LoadOptions.from_args(parser.parse_args([])).tokenizer is None
    with pytest.raises(TypeError, match="tokenizer inside options"):
        MoEEmbedder.from_pretrained("x", LoadOptions(), tokenizer="t")


def test_split_revision(tmp_path):
    assert split_revision("org/model@step100") == ("org/model", "step100")
    assert split_revision("org/model") == ("org/model", None)
    odd = tmp_path / "a@b"
    odd.mkdir()
    assert split_revision(str(odd)) == (str(odd), None)


def test_init_from_a_training_checkpoint_continues_it(corpus, run, tmp_path):  # noqa: F811
    from moee.moe.trainer import train

    cfg = tiny_cfg(corpus, tmp_path / "more", max_steps=2)
    cfg["model"], cfg["init"] = {}, {"from": str(run["checkpoint"])}
    result = train(cfg, progress=False)
    assert result.step == 2 and result.checkpoint is not None


# ------------------------------------------------------------------ moee report --checkpoints


@pytest.mark.slow
def test_report_checkpoints_of_a_deepseek_v1_model(tmp_path):
    ckpts = []
    for seed in (0, 1):
        path = tmp_path / f"deepseek-step{seed + 1}"
        tiny_model("deepseek", n_layers=2, seed=seed).save_pretrained(path)
        tiny_tokenizer().save_pretrained(path)
        ckpts.append(str(path))
    rng = np.random.default_rng(0)
    corpus_file = tmp_path / "corpus.txt"
    corpus_file.write_text("\n".join(" ".join(rng.choice(TINY_WORDS, size=8)) for _ in range(12)) + "\n")
    argv = ["report", "--checkpoints", *ckpts, "--corpus", str(corpus_file), "--out", str(tmp_path / "rep")]
    assert main(argv + ["--device", "cpu", "--permutations", "1", "--token-view-texts", "0"]) == 0
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert report["saturation"]["final"] == ckpts[-1]
    assert len(report["saturation"]["checkpoints"]) == 2
    assert report["summary"]["n_texts"] == 12
