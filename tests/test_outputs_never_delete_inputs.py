"""Outputs never delete inputs: every command that writes a folder (or a file) refuses one that is,
holds or lies inside one of its inputs, before any work; ``--overwrite`` replaces only the files
the command's previous run wrote (``moee.io.commit_folder``) and a user's other files and folders
stay. Also the argument checks that come with it: ``moee ablate``'s selection flags, ``moee
upcycle --router-option`` values."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import moee.io
from moee.cli import main
from moee.io import (
    FolderOutput,
    StagedFolder,
    check_not_an_input,
    check_output_folder,
    read_output_record,
)

KIND = FolderOutput("moee test", owned=("result.txt", "*.part"), last=("result.txt",))


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (hidden ones too) by relative path -> bytes."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _visible(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if not p.name.startswith("."))


def _user_files(folder: Path) -> None:
    """What a user keeps in an output folder: a notes file and a sub-folder with a file."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "notes.txt").write_text("my notes")
    (folder / "mine").mkdir(exist_ok=True)
    (folder / "mine" / "keep.txt").write_text("keep me")


def _user_files_survive(folder: Path) -> bool:
    return (folder / "notes.txt").read_text() == "my notes" and (
        folder / "mine" / "keep.txt"
    ).read_text() == "keep me"


def _write(out: Path, files: dict[str, str], kind: FolderOutput = KIND) -> None:
    with StagedFolder(out, kind) as staging:
        for name, text in files.items():
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            (staging / name).write_text(text)


# ----------------------------------------------------------------------------- the helper


def test_an_output_that_is_holds_or_lies_inside_an_input_is_refused_naming_both(tmp_path):
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "corpus.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "alias").symlink_to(data)
    cases = [
        (data, "is the input SRC"),
        (tmp_path / "alias", "is the input SRC"),  # the same folder under another name
        (tmp_path, "holds the input SRC"),
        (data / "sub" / "out", "lies inside the input SRC"),
    ]
    for out, relation in cases:
        with pytest.raises(ValueError, match=relation) as caught:
            check_not_an_input(out, {"SRC": str(data)})
        assert str(out) in str(caught.value) and str(data) in str(caught.value)
    with pytest.raises(ValueError, match="holds the input --corpus"):
        check_not_an_input(tmp_path, {"--corpus": [data / "corpus.jsonl"]})
    # a Hub id, a missing path and an unrelated folder are no inputs on disk; a file output inside
    # an input folder replaces nothing of it
    check_not_an_input(tmp_path / "out", {"--model": "org/model", "SRC": tmp_path / "missing", "x": None})
    check_not_an_input(data / "merged.npy", {"--merge": data}, folder=False)
    with pytest.raises(ValueError, match="is the input INPUT"):
        check_not_an_input(data / "corpus.jsonl", {"INPUT": data / "corpus.jsonl"}, folder=False)


def test_overwrite_replaces_the_previous_runs_files_and_keeps_the_users(tmp_path):
    out = tmp_path / "out"
    _write(out, {"result.txt": "1", "a.part": "1", "deep/b.part": "1"})
    assert read_output_record(out)["files"] == ["a.part", "deep/b.part", "result.txt"]
    _user_files(out)
    with pytest.raises(FileExistsError, match="pass --overwrite"):
        check_output_folder(out, overwrite=False, output=KIND)
    check_output_folder(out, overwrite=True, output=KIND)
    _write(out, {"result.txt": "2", "c.part": "2"})
    assert _visible(out) == ["c.part", "mine", "notes.txt", "result.txt"]  # a.part, deep/ gone
    assert (out / "result.txt").read_text() == "2" and _user_files_survive(out)
    record = read_output_record(out)
    assert record["files"] == ["c.part", "result.txt"] and record["complete"] is True
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging folder or lock left


def test_a_folder_holding_another_commands_output_is_refused(tmp_path):
    out = tmp_path / "out"
    _write(out, {"model.safetensors": "weights"}, FolderOutput("moee upcycle"))
    before = _tree(out)
    with pytest.raises(FileExistsError, match="holds the output of `moee upcycle`"):
        check_output_folder(out, overwrite=True, output=KIND)
    with pytest.raises(FileExistsError, match="holds the output of `moee upcycle`"):
        _write(out, {"result.txt": "x"})
    assert _tree(out) == before


def test_an_interrupted_commit_leaves_no_finished_looking_folder_and_the_next_clears_it(
    tmp_path, monkeypatch
):
    out = tmp_path / "out"
    _write(out, {"result.txt": "old", "a.part": "old"})
    _user_files(out)
    real = os.replace

    def killed_midway(src, dst):
        if Path(dst).name == "new.part":
            raise KeyboardInterrupt  # a kill while the new files go in
        return real(src, dst)

    monkeypatch.setattr(moee.io.os, "replace", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        _write(out, {"result.txt": "new", "b.part": "new", "new.part": "new"})
    monkeypatch.setattr(moee.io.os, "replace", real)
    assert not (out / "result.txt").exists()  # what a reader opens first: gone, never old beside new
    assert not (out / "a.part").exists() and _user_files_survive(out)
    record = read_output_record(out)
    assert record["complete"] is False and "b.part" in record["files"] and "new.part" in record["files"]
    _write(out, {"result.txt": "again"})
    assert _visible(out) == ["mine", "notes.txt", "result.txt"] and _user_files_survive(out)


def test_a_folder_written_before_records_loses_only_the_commands_own_names(tmp_path):
    parquet = moee.io.PARQUET_OUTPUT
    legacy = tmp_path / "legacy"  # a Parquet embeddings folder of an older moee: no record
    legacy.mkdir()
    for name in ("0_000000.parquet", "1_000000.parquet", moee.io.PARQUET_SIDECAR, "notes.txt"):
        (legacy / name).write_text("x")
    _write(legacy, {"2_000000.parquet": "new", moee.io.PARQUET_SIDECAR: "new"}, parquet)
    assert _visible(legacy) == ["2_000000.parquet", "_embeddings.json", "notes.txt"]
    plain = tmp_path / "plain"  # no sidecar: its .parquet files are not embeddings, they stay
    plain.mkdir()
    (plain / "table.parquet").write_text("user data")
    _write(plain, {"2_000000.parquet": "new", moee.io.PARQUET_SIDECAR: "new"}, parquet)
    assert (plain / "table.parquet").read_text() == "user data"


def test_a_user_folder_where_an_output_file_goes_is_refused_before_anything_changes(tmp_path):
    out = tmp_path / "out"
    _write(out, {"a.part": "old"})
    (out / "result.txt").mkdir()
    before = _tree(out)
    with pytest.raises(IsADirectoryError, match="is in the way"):
        _write(out, {"result.txt": "new"})
    assert _tree(out) == before


# ----------------------------------------------------------------------------- moee upcycle


@pytest.fixture
def dense_dir(tmp_path):
    from test_moe_upcycle import dense_model

    from moee.capture.tiny import tiny_tokenizer

    dense = tmp_path / "dense"
    dense_model("llama").save_pretrained(dense)
    tiny_tokenizer().save_pretrained(dense)
    (dense / "notes.txt").write_text("about this model")
    return dense


@pytest.fixture
def no_loading(monkeypatch):
    import moee.moe.upcycle as upcycle_mod

    def refuse(*args, **kwargs):
        raise AssertionError("the dense model was loaded before the inputs were checked")

    monkeypatch.setattr(upcycle_mod, "_load_dense", refuse)


def _upcycle(src, out, *extra):
    return ["upcycle", str(src), "--out", str(out), "--experts", "4", "--top-k", "2", *extra]


def test_upcycle_into_its_source_or_around_it_is_refused_before_loading(
    dense_dir, tmp_path, capsys, no_loading
):
    before = _tree(dense_dir)
    for out, relation in ((dense_dir, "is"), (tmp_path, "holds")):
        assert main(_upcycle(dense_dir, out, "--overwrite")) == 2
        err = capsys.readouterr().err
        assert f"--out {out} {relation} the input SRC {dense_dir}" in err
    assert main(_upcycle(dense_dir, dense_dir / "moe")) == 2
    assert "lies inside the input SRC" in capsys.readouterr().err
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "calib.jsonl").write_text('{"text": "the river"}\n')
    assert main(_upcycle(dense_dir, texts, "--overwrite", "--calibrate", str(texts / "calib.jsonl"))) == 2
    assert "holds the input --calibrate" in capsys.readouterr().err
    assert _tree(dense_dir) == before and (texts / "calib.jsonl").is_file()


@pytest.mark.slow
def test_upcycle_overwrite_keeps_a_users_notes_and_sub_folder(dense_dir, tmp_path, capsys):
    out = tmp_path / "moe"
    assert main(_upcycle(dense_dir, out)) == 0
    _user_files(out)
    assert main(_upcycle(dense_dir, out, "--overwrite", "--mode", "copy")) == 0
    assert (
        _user_files_survive(out) and json.loads((out / "config.json").read_text())["upcycle_mode"] == "copy"
    )
    assert read_output_record(out)["writer"] == "moee upcycle"


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("router_noisy=maybe", "router_noisy takes true or false (also 1/0, yes/no)"),
        ("router_capacity_factor=nan", "router_capacity_factor takes a finite number, or null"),
        ("router_capacity_factor=inf", "router_capacity_factor takes a finite number, or null"),
        ("router_n_groups=2.5", "router_n_groups takes an integer, or null"),
        ("router_min_capacity=null", "router_min_capacity takes an integer"),
    ],
)
def test_a_router_option_that_does_not_parse_by_its_type_is_refused_before_loading(
    dense_dir, tmp_path, capsys, no_loading, option, message
):
    assert main(_upcycle(dense_dir, tmp_path / "moe", "--router-option", option)) == 2
    err = capsys.readouterr().err
    assert f"--router-option {option.split('=')[0]}=" in err and message in err
    assert not (tmp_path / "moe").exists()


def test_router_options_parse_by_the_fields_type():
    from moee.commands.upcycle import router_options
    from moee.moe.upcycle import upcycle

    assert router_options(["router_noisy=no", "router_w_load=1e-2", "router_n_groups=4"]) == {
        "router_noisy": False,
        "router_w_load": 0.01,
        "router_n_groups": 4,
    }
    assert router_options(["router_noisy=YES"]) == {"router_noisy": True}
    with pytest.raises(ValueError, match="router_noisy is given twice"):
        router_options(["router_noisy=true", "router_noisy=false"])
    for bad in (
        {"router_noisy": "maybe"},
        {"router_capacity_factor": float("nan")},
        {"router_n_groups": 2.0},
    ):
        with pytest.raises(ValueError, match=f"router option {next(iter(bad))} must be"):
            upcycle("unused", n_experts=4, top_k=1, router_options=bad)


# ----------------------------------------------------------------------------- moee report

REPORT_FAST = ["--device", "cpu", "--permutations", "1", "--token-view-texts", "1"]


def _report(model, corpus, out, *extra):
    return ["report", "--model", str(model), "--corpus", str(corpus), "--out", str(out), *REPORT_FAST, *extra]


@pytest.fixture
def model_copy(tiny_model_dir, tmp_path):
    """The tiny model in a folder of this test's own, with a corpus beside it."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat\na dog ran in the park\n" * 3)
    return model, corpus


def test_report_into_its_model_or_around_its_corpus_is_refused_before_routing(model_copy, tmp_path, capsys):
    model, corpus = model_copy
    before = _tree(model)
    assert main(_report(model, corpus, model, "--overwrite")) == 2
    assert f"report folder {model} is the input --model {model}" in capsys.readouterr().err
    assert main(_report(model, corpus, tmp_path, "--overwrite")) == 2
    assert "holds the input --model" in capsys.readouterr().err
    assert _tree(model) == before and corpus.is_file()


@pytest.mark.slow
def test_report_overwrite_keeps_a_users_notes_and_sub_folder(model_copy, tmp_path):
    model, corpus = model_copy
    out = tmp_path / "rep"
    assert main(_report(model, corpus, out)) == 0
    _user_files(out)
    assert main(_report(model, corpus, out, "--overwrite", "--seed", "2")) == 0
    assert _visible(out) == ["mine", "notes.txt", "report.html", "report.json"] and _user_files_survive(out)


# ----------------------------------------------------------------------------- moee ablate


@pytest.fixture
def ablate_corpus(tmp_path):
    words = "the cat sat on the mat and a dog ran in the park".split()
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(words[i:] + words[:i])}) + "\n" for i in range(6)))
    return path


def _ablate(model, corpus, out, *extra):
    return [
        "ablate",
        "--model",
        str(model),
        "--corpus",
        str(corpus),
        "--out",
        str(out),
        "--device",
        "cpu",
        *extra,
    ]


@pytest.fixture
def no_forward(monkeypatch):
    """Fail the test if a forward pass starts (the corpus is built just before the first)."""
    import moee.analysis.expert_importance as ei

    def refuse(*args, **kwargs):
        raise AssertionError("a forward pass began before the flags were checked")

    monkeypatch.setattr(ei, "build_corpus", refuse)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--layers", "0", "--experts", "1:3"], "--experts 1:3 lie outside --layers 0"),
        (["--experts", "0:1", "0:1"], "--experts names 0:1 twice"),
        (["--layers", "1", "1"], "--layers names 1 twice"),
        (["--steer", "0:1=1", "0:1=2"], "--steer names 0:1 twice"),
        (["--experts", "0:99"], "--experts: expert 99 out of range in MoE layer 0"),
        (["--steer", "5:0=1"], "--steer: MoE layer 5 out of range"),
    ],
)
def test_ablate_selection_flags_are_checked_before_any_forward_pass(
    tiny_model_dir, ablate_corpus, tmp_path, capsys, no_forward, flags, message
):
    out = tmp_path / "out"
    assert main(_ablate(tiny_model_dir, ablate_corpus, out, *flags)) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_a_non_finite_steering_bias_is_refused_by_the_parser_naming_the_flag(
    tiny_model_dir, ablate_corpus, tmp_path, capsys
):
    for bias in ("nan", "inf", "-inf"):
        with pytest.raises(SystemExit) as exited:
            main(_ablate(tiny_model_dir, ablate_corpus, tmp_path / "out", "--steer", f"0:0={bias}"))
        assert exited.value.code == 2
        assert f"argument --steer: BIAS must be a finite number, got '0:0={bias}'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_ablate_into_its_model_is_refused_and_overwrite_replaces_any_kind_of_run_keeping_user_files(
    tiny_model_dir, ablate_corpus, tmp_path, capsys
):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    before = _tree(model)
    assert main(_ablate(model, ablate_corpus, model, "--overwrite", "--layers", "1", "--no-null")) == 2
    assert "is the input --model" in capsys.readouterr().err and _tree(model) == before
    out = tmp_path / "out"
    assert main(_ablate(model, ablate_corpus, out, "--layers", "1", "--no-null")) == 0
    _user_files(out)
    assert (
        main(_ablate(model, ablate_corpus, out, "--overwrite", "--steer", "1:2=2", "--null-draws", "1")) == 0
    )
    assert _visible(out) == ["README.md", "mine", "notes.txt", "steering.json"]  # importance files gone
    assert _user_files_survive(out) and "# Expert steering" in (out / "README.md").read_text()


def test_expert_importance_refuses_an_empty_selection_before_the_baseline(tiny_olmoe, monkeypatch):
    import moee.analysis.expert_importance as ei

    monkeypatch.setattr(ei, "baseline", lambda *a, **k: pytest.fail("the baseline ran"))
    with pytest.raises(ValueError, match="experts is empty"):
        ei.expert_importance(tiny_olmoe, None, experts=[])


# ----------------------------------------------------------------------------- moee embed


def _shards(tmp_path):
    from test_shard import SETTINGS, FakeEncoder

    from moee import shard

    corpus = tmp_path / "c.txt"
    corpus.write_text("".join(f"text number {i}\n" for i in range(9)))
    out_dir = tmp_path / "shards"
    for rank in range(2):
        shard.embed_shard(
            FakeEncoder(), shard.ShardRun(corpus, out_dir, shard.ShardInfo(rank, 2, rank), SETTINGS)
        )
    return corpus, out_dir


def test_merge_into_its_shards_or_around_them_is_refused_before_reading(tmp_path, capsys):
    corpus, shards = _shards(tmp_path)
    before = _tree(shards)
    for out, relation in ((shards, "is"), (tmp_path, "holds"), (shards / "pq", "lies inside")):
        assert main(["embed", "--merge", str(shards), "--out", str(out), "--overwrite"]) == 2
        assert f"{relation} the input --merge {shards}" in capsys.readouterr().err
    assert _tree(shards) == before and corpus.is_file()


def test_merge_to_parquet_overwrite_keeps_a_users_notes_and_sub_folder(tmp_path, capsys):
    from moee.io import read_embeddings

    _, shards = _shards(tmp_path)
    out = tmp_path / "pq"
    assert main(["embed", "--merge", str(shards), "--out", str(out)]) == 0
    first = sorted(p.name for p in out.glob("*.parquet"))
    _user_files(out)
    assert main(["embed", "--merge", str(shards), "--out", str(out), "--overwrite"]) == 0
    assert _user_files_survive(out) and read_embeddings(out)[0].shape == (9, 4)
    assert len(list(out.glob("*.parquet"))) == len(first)  # the previous run's part files are gone


def test_ray_embed_into_its_input_folder_is_refused_before_ray_starts(tmp_path):
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'moee[ray]')")
    from moee.embed.settings import EmbedSettings
    from moee.integrations.ray import embed_files

    data = tmp_path / "d"
    (data / "sub").mkdir(parents=True)
    (data / "in.jsonl").write_text('{"text": "a"}\n')
    (data / "sub" / "x.txt").write_text("keep")
    before = _tree(data)
    for out in (data, tmp_path):
        with pytest.raises(ValueError, match="the input INPUT"):
            embed_files(EmbedSettings(input=str(data), out=str(out), overwrite=True, engine="ray"))
    assert _tree(data) == before


def test_an_embeddings_or_index_output_that_is_an_input_is_refused(tmp_path, capsys):
    import numpy as np

    from moee.io import texts_digest, write_embeddings

    texts = tmp_path / "t.txt"
    texts.write_text("a\nb\nc\n")
    meta = {"method": "hs", "pooling": "mean", "score": "softmax", "alpha": 1.0}
    meta["texts_sha256"] = texts_digest(["a", "b", "c"])[0]
    emb = write_embeddings(tmp_path / "e.npy", np.eye(3, dtype=np.float32), meta)
    before = _tree(tmp_path)
    argv = ["search", "--embeddings", str(emb), "--texts", str(texts), "--query", "x", "--overwrite"]
    for index in (emb, texts):
        assert main([*argv, "--save-index", str(index)]) == 2
        assert f"--save-index {index} is the input" in capsys.readouterr().err
    assert _tree(tmp_path) == before
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": ["a b"]}), table)
    assert main(["routes", "--corpus", str(table), "--out", str(table), "--overwrite"]) == 2
    assert "is the input --corpus" in capsys.readouterr().err and pq.read_table(table).num_rows == 1


# ----------------------------------------------------------------------------- moee train / evaluate


def test_train_overwrite_never_deletes_its_start_or_data(tmp_path):
    from test_moe_trainer import tiny_cfg

    from moee.moe.trainer import train

    root = tmp_path / "corpus"
    (root / "tok").mkdir(parents=True)
    for name in ("train", "heldout"):
        (root / f"{name}.jsonl").write_text('{"text": "a b"}\n')
    run = tmp_path / "run"
    start = run / "step_00000002"  # an earlier checkpoint of the same folder as the start
    start.mkdir(parents=True)
    (start / "config.json").write_text("{}")
    cfg = {**tiny_cfg({"root": root}, run), "model": {}, "init": {"from": str(start)}}
    with pytest.raises(ValueError, match=f"checkpoint.dir {run} holds the input init.from {start}"):
        train(cfg, overwrite=True, progress=False)
    assert (start / "config.json").is_file()
    with pytest.raises(ValueError, match="holds the input data.train"):
        train(tiny_cfg({"root": root}, root), overwrite=True, progress=False)
    assert (root / "train.jsonl").is_file()


@pytest.mark.slow
def test_evaluate_into_its_model_is_refused(tiny_model_dir, capsys):
    assert main(["evaluate", "--model", tiny_model_dir, "--out", tiny_model_dir, "--tasks", "mini"]) == 2
    assert f"--out {tiny_model_dir} is the input --model" in capsys.readouterr().err
