"""What `moee report` writes and checks first: every input before the first model is routed, an
existing report refused without --overwrite, the two files committed together, a re-runnable
command line."""

from __future__ import annotations

import json
import shlex

import numpy as np
import pytest

import moee.analysis.specialization.report as report_mod
from moee.capture.tiny import TINY_WORDS, tiny_model, tiny_tokenizer
from moee.cli import main

FAST = ["--device", "cpu", "--permutations", "1", "--token-view-texts", "1"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "olmoe"
    tiny_model("olmoe", n_layers=2).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def corpus(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(" ".join(rng.choice(TINY_WORDS, size=6)) for _ in range(8)) + "\n")
    return path


@pytest.fixture
def no_routing(monkeypatch):
    """Fail the test if a report is built: the checks must come first."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was routed before the inputs were checked")

    import moee.analysis.specialization as package

    monkeypatch.setattr(package, "build_report", refuse)
    monkeypatch.setattr(package, "saturation_section", refuse)


def _argv(model_dir, corpus, out, *extra):
    return ["report", "--model", str(model_dir), "--corpus", str(corpus), "--out", str(out), *FAST, *extra]


@pytest.mark.slow
def test_an_existing_report_is_refused_without_overwrite_and_replaced_with_it(
    model_dir, corpus, tmp_path, capsys
):
    out = tmp_path / "rep"
    assert main(_argv(model_dir, corpus, out)) == 0
    first = json.loads((out / "report.json").read_text())["meta"]["timestamp"]
    html = (out / "report.html").read_bytes()
    capsys.readouterr()
    assert main(_argv(model_dir, corpus, out)) == 2
    assert "pass --overwrite" in capsys.readouterr().err
    assert (out / "report.html").read_bytes() == html
    assert json.loads((out / "report.json").read_text())["meta"]["timestamp"] == first
    assert main(_argv(model_dir, corpus, out, "--overwrite", "--seed", "3")) == 0
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "report.html",
        "report.json",
    ]
    assert "--seed 3" in json.loads((out / "report.json").read_text())["meta"]["command"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging left


@pytest.mark.slow
def test_a_kill_while_writing_never_pairs_a_new_json_with_the_old_html(
    model_dir, corpus, tmp_path, monkeypatch
):
    out = tmp_path / "rep"
    assert main(_argv(model_dir, corpus, out)) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real = report_mod.render_html

    def killed_writing_the_page(report, **options):
        killed_writing_the_page.calls += 1
        raise KeyboardInterrupt  # the page of the new report is never written

    killed_writing_the_page.calls = 0
    monkeypatch.setattr(report_mod, "render_html", killed_writing_the_page)
    with pytest.raises(KeyboardInterrupt):
        main(_argv(model_dir, corpus, out, "--overwrite", "--seed", "5"))
    assert killed_writing_the_page.calls == 1
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the old pair, whole
    monkeypatch.setattr(report_mod, "render_html", real)

    import moee.io

    def killed_before_the_rename(staging, target, output):
        raise SystemExit(9)

    monkeypatch.setattr(moee.io, "commit_folder", killed_before_the_rename)
    with pytest.raises(SystemExit):
        main(_argv(model_dir, corpus, out, "--overwrite", "--seed", "5"))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    staged = [p for p in tmp_path.iterdir() if p.name.startswith(".rep.tmp-")]
    assert len(staged) == 1 and sorted(p.name for p in staged[0].iterdir()) == ["report.html", "report.json"]


def test_write_report_writes_both_files_in_one_commit(tmp_path, monkeypatch):
    """The folder appears by one rename holding both files, never one file at a time."""
    import moee.io

    seen = []
    real = moee.io.commit_folder

    def spy(staging, target, output):
        seen.append(sorted(p.name for p in staging.iterdir()))
        assert not target.exists()
        return real(staging, target, output)

    monkeypatch.setattr(moee.io, "commit_folder", spy)
    report = {s.id: {} for s in report_mod.registry.SECTIONS}
    monkeypatch.setattr(report_mod, "render_html", lambda report, **options: "<html></html>")
    paths = report_mod.write_report(report, tmp_path / "rep")
    assert seen == [["report.html", "report.json"]] and paths["html"].read_text() == "<html></html>"
    monkeypatch.setattr(moee.io, "commit_folder", real)
    (tmp_path / "other").mkdir()  # a folder with a user's file: the report lands beside it
    (tmp_path / "other" / "embeddings.npy").write_bytes(b"x")
    with pytest.raises(FileExistsError, match="exists and is not empty; pass --overwrite"):
        report_mod.write_report(report, tmp_path / "other", overwrite=False)
    report_mod.write_report(report, tmp_path / "other")
    assert (tmp_path / "other" / "embeddings.npy").read_bytes() == b"x"
    assert (tmp_path / "other" / "report.html").read_text() == "<html></html>"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--compare", "{missing}"], "--compare {missing}: model directory"),
        (["--compare", "{corpus}"], "--compare {corpus}: model"),
        (["--compare", "{empty_dir}"], "holds no config.json"),
        (["--checkpoints", "{model}", "{missing}"], "--checkpoints {missing}: model directory"),
    ],
)
def test_a_bad_compare_or_checkpoint_path_is_found_before_any_model_is_routed(
    model_dir, corpus, tmp_path, capsys, no_routing, flags, message
):
    names = {
        "missing": str(tmp_path / "no-such-model"),
        "corpus": str(corpus),
        "empty_dir": str(tmp_path / "empty"),
        "model": str(model_dir),
    }
    (tmp_path / "empty").mkdir()
    flags = [f.format(**names) for f in flags]
    argv = ["report", "--corpus", str(corpus), "--out", str(tmp_path / "rep"), *FAST, *flags]
    if "--checkpoints" not in flags:
        argv += ["--model", str(model_dir)]
    assert main(argv) == 2
    assert message.format(**names) in capsys.readouterr().err
    assert not (tmp_path / "rep").exists()


@pytest.mark.parametrize("content", ["\n\n\n", "  \n\t\n"])
def test_a_corpus_of_empty_texts_is_an_error_before_routing(model_dir, tmp_path, capsys, no_routing, content):
    corpus = tmp_path / "empty.txt"
    corpus.write_text(content)
    assert main(_argv(model_dir, corpus, tmp_path / "rep")) == 2
    assert "are empty (or only whitespace); there is nothing to route" in capsys.readouterr().err


def test_a_bad_corpus_row_is_an_error_before_routing(model_dir, tmp_path, capsys, no_routing):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "a b"}\n{"body": "c"}\n')
    assert main(_argv(model_dir, corpus, tmp_path / "rep")) == 2
    assert ":2: no field 'text'" in capsys.readouterr().err


@pytest.mark.slow
def test_meta_command_records_the_checkpoints_as_a_shell_line(model_dir, corpus, tmp_path):
    second = tmp_path / "step 2"  # a space: the line must be shell-quoted
    tiny_model("olmoe", n_layers=2, seed=1).save_pretrained(second)
    tiny_tokenizer().save_pretrained(second)
    argv = ["report", "--checkpoints", str(model_dir), str(second), "--corpus", str(corpus)]
    argv += ["--out", str(tmp_path / "rep"), *FAST]
    assert main(argv) == 0
    command = json.loads((tmp_path / "rep" / "report.json").read_text())["meta"]["command"]
    words = shlex.split(command)
    at = words.index("--checkpoints")
    assert words[at + 1 : at + 3] == [str(model_dir), str(second)]
    assert "[" not in command


def test_a_compare_hub_id_that_cannot_be_found_is_refused_before_routing(
    model_dir, corpus, tmp_path, capsys, no_routing, monkeypatch
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(_argv(model_dir, corpus, tmp_path / "rep", "--compare", "no-such-org/no-such-model")) == 2
    assert "--compare no-such-org/no-such-model: cannot find this model" in capsys.readouterr().err
