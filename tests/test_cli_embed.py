"""`moee embed` and `moee search` end to end with a tiny randomly initialised OLMoE on disk."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moee.cli import main
from moee.embed.embedder import MoEEmbedder
from moee.embed.methods import DEFAULT_SCORE
from moee.io import read_embeddings, sidecar_path

TEXTS = [
    "the cat sat on the mat",
    "a dog ran under the tree",
    "",
    'the "big" red house',
    "music and science",
    "the sun over the river",
    "rain at night",
]


@pytest.fixture(scope="module")
def embedder(tiny_model_dir):
    return MoEEmbedder.from_pretrained(tiny_model_dir, device="cpu")


@pytest.fixture()
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(TEXTS) + "\n")
    return path


def test_embed_txt_matches_python_api(tmp_path, corpus, tiny_model_dir, embedder):
    out = tmp_path / "e.npy"
    argv = ["embed", str(corpus), "--model", tiny_model_dir, "--out", str(out), "--prompt", "prompteol"]
    assert main([*argv, "--alpha", "0.5", "--device", "cpu", "--chunk-size", "3", "--batch-size", "2"]) == 0
    arr, meta = read_embeddings(out)
    expected = embedder.encode(TEXTS, prompt="prompteol", alpha=0.5)
    assert arr.shape == expected.shape == (len(TEXTS), 64 + 2 * 8)
    np.testing.assert_allclose(arr, expected, atol=1e-5)
    assert meta["model"] == tiny_model_dir and meta["method"] == "moee_sum" and meta["pooling"] == "last"
    assert meta["prompt"] == "prompteol" and meta["prompt_template"].startswith("This sentence :")
    assert meta["score"] == DEFAULT_SCORE and meta["alpha"] == 0.5 and meta["normalize"] is True
    assert meta["array_dtype"] == "float32" and meta["shape"] == [len(TEXTS), 80]
    assert {"torch", "transformers", "moee"} <= set(meta["versions"])
    assert meta["command"] and meta["timestamp"] and meta["batch_size"] == 2


@pytest.mark.parametrize("method", ["hs", "rw", "moee_concat"])
def test_embed_methods_and_jsonl_field(tmp_path, tiny_model_dir, embedder, method):
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"id": i, "body": t}) + "\n" for i, t in enumerate(TEXTS)))
    out = tmp_path / "e.npy"
    argv = [
        "embed",
        str(path),
        "--field",
        "body",
        "--model",
        tiny_model_dir,
        "--out",
        str(out),
        "--method",
        method,
    ]
    assert main([*argv, "--pooling", "mean", "--device", "cpu"]) == 0
    arr, meta = read_embeddings(out)
    np.testing.assert_allclose(arr, embedder.encode(TEXTS, method=method, pooling="mean"), atol=1e-5)
    assert meta["field"] == "body" and meta["pooling"] == "mean"


def test_embed_parquet(tmp_path, tiny_model_dir, embedder):
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": TEXTS}), path)
    out = tmp_path / "e.npy"
    assert main(["embed", str(path), "--model", tiny_model_dir, "--out", str(out), "--device", "cpu"]) == 0
    np.testing.assert_allclose(np.load(out), embedder.encode(TEXTS), atol=1e-5)


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--prompt", "prompt_eol"], "unknown prompt 'prompt_eol'"),
        (["--alpha", "-1"], "alpha must be >= 0"),
        (["--batch-size", "0"], "--batch-size must be >= 1"),
        (["--field", "text"], "field applies to .jsonl and .parquet"),
    ],
)
def test_embed_bad_arguments(tmp_path, corpus, tiny_model_dir, capsys, extra, message):
    out = tmp_path / "e.npy"
    assert main(["embed", str(corpus), "--model", tiny_model_dir, "--out", str(out), *extra]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.glob("*.partial"))


def test_embed_bad_inputs(tmp_path, tiny_model_dir, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert main(["embed", str(empty), "--model", tiny_model_dir, "--out", str(tmp_path / "e.npy")]) == 2
    assert "is empty" in capsys.readouterr().err
    assert not list(tmp_path.glob("e.npy*"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"txt": "b"}\n')
    assert main(["embed", str(bad), "--model", tiny_model_dir, "--out", str(tmp_path / "e.npy")]) == 2
    assert "bad.jsonl:2: no field 'text'" in capsys.readouterr().err
    assert main(["embed", str(tmp_path / "none.txt"), "--out", str(tmp_path / "e.npy")]) == 2
    assert "input file not found" in capsys.readouterr().err
    good = tmp_path / "good.txt"
    good.write_text("a\n")
    assert main(["embed", str(good), "--model", tiny_model_dir, "--out", str(tmp_path / "e.bin")]) == 2
    assert "--out must be a .npy file" in capsys.readouterr().err
    assert main(["embed", "--out", str(tmp_path / "e.npy")]) == 2
    assert "INPUT is required" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["embed", str(good), "--out", str(tmp_path / "e.npy"), "--method", "mean"])


def test_search_finds_the_query_text(tmp_path, corpus, tiny_model_dir, capsys):
    emb = tmp_path / "corpus.npy"
    assert (
        main(["embed", str(corpus), "--model", tiny_model_dir, "--out", str(emb), "--prompt", "prompteol"])
        == 0
    )
    capsys.readouterr()
    queries = tmp_path / "q.txt"
    queries.write_text("rain at night\n")
    argv = ["search", "--embeddings", str(emb), "--texts", str(corpus), "--query", TEXTS[0]]
    index_path = tmp_path / "corpus.faiss"
    assert (
        main([*argv, "--query-file", str(queries), "-k", "3", "--json", "--save-index", str(index_path)]) == 0
    )
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [entry["query"] for entry in lines] == [TEXTS[0], "rain at night"]
    # the sidecar's model/method/prompt embed the query, so a corpus text finds itself first
    assert lines[0]["results"][0] == {
        "rank": 1,
        "id": 0,
        "score": pytest.approx(1.0, abs=1e-4),
        "text": TEXTS[0],
    }
    assert lines[1]["results"][0]["id"] == 6
    assert [r["rank"] for r in lines[0]["results"]] == [1, 2, 3]
    assert index_path.is_file() and sidecar_path(index_path).is_file()
    # a saved index gives the same answer; plain-text output
    assert main([*argv, "--load-index", str(index_path), "-k", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"query: {TEXTS[0]}\n") and f"[0]  {TEXTS[0]}" in out


def test_search_errors(tmp_path, corpus, tiny_model_dir, capsys):
    emb = tmp_path / "corpus.npy"
    assert main(["embed", str(corpus), "--model", tiny_model_dir, "--out", str(emb), "--method", "hs"]) == 0
    other = tmp_path / "other.txt"
    other.write_text("only\ntwo\n")
    argv = ["search", "--embeddings", str(emb), "--query", "cat"]
    assert main([*argv, "--texts", str(other)]) == 2
    assert "has 2 texts but the embeddings have 7 rows" in capsys.readouterr().err
    assert main(["search", "--embeddings", str(emb), "--texts", str(corpus)]) == 2
    assert "at least one --query" in capsys.readouterr().err
    assert main([*argv, "--texts", str(corpus), "-k", "0"]) == 2
    assert "-k must be >= 1" in capsys.readouterr().err
    np.save(tmp_path / "bare.npy", np.zeros((7, 4), np.float32))
    assert (
        main(["search", "--embeddings", str(tmp_path / "bare.npy"), "--texts", str(corpus), "--query", "x"])
        == 2
    )
    assert "sidecar" in capsys.readouterr().err


def test_prompt_none_and_relative_model_path(tmp_path, corpus, tiny_model_dir, embedder, monkeypatch, capsys):
    import shutil

    work = tmp_path / "work"
    shutil.copytree(tiny_model_dir, work / "m")
    monkeypatch.chdir(work)
    out = tmp_path / "e.npy"
    assert (
        main(["embed", str(corpus), "--model", "m", "--out", str(out), "--prompt", "none", "--method", "rw"])
        == 0
    )
    arr, meta = read_embeddings(out)
    assert meta["prompt"] is None and meta["prompt_template"] is None and meta["model"] == "m"
    assert meta["model_resolved"] == str((work / "m").resolve())
    np.testing.assert_allclose(arr, embedder.encode(TEXTS, method="rw"), atol=1e-5)
    # search from elsewhere still finds the model through the recorded absolute path
    monkeypatch.chdir(tmp_path)
    argv = [
        "search",
        "--embeddings",
        str(out),
        "--texts",
        str(corpus),
        "--query",
        TEXTS[4],
        "-k",
        "1",
        "--json",
    ]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["id"] == 4


def test_device_map_and_quantization_options(tmp_path, corpus, tiny_model_dir, embedder, capsys):
    import importlib.util

    out = tmp_path / "e.npy"
    assert (
        main(["embed", str(corpus), "--model", tiny_model_dir, "--out", str(out), "--device-map", "auto"])
        == 0
    )
    np.testing.assert_allclose(np.load(out), embedder.encode(TEXTS), atol=1e-5)
    assert read_embeddings(out)[1]["load_in_4bit"] is False
    argv = ["embed", str(corpus), "--model", tiny_model_dir, "--out", str(tmp_path / "f.npy")]
    assert main([*argv, "--device", "cpu", "--device-map", "auto"]) == 2
    assert "either --device or --device-map" in capsys.readouterr().err
    if importlib.util.find_spec("bitsandbytes") is None:
        assert main([*argv, "--load-in-4bit"]) == 2
        assert "--load-in-4bit needs bitsandbytes" in capsys.readouterr().err


def test_search_reloads_the_model_in_the_recorded_dtype(
    tmp_path, corpus, tiny_model_dir, monkeypatch, capsys
):
    out = tmp_path / "e.npy"
    assert (
        main(["embed", str(corpus), "--model", tiny_model_dir, "--out", str(out), "--dtype", "bfloat16"]) == 0
    )
    meta = read_embeddings(out)[1]
    assert meta["model_dtype"] == "bfloat16" and meta["array_dtype"] == "float32"
    seen = []
    real = MoEEmbedder.from_pretrained

    def recording(name, options=None, **kw):
        seen.append(options.dtype)
        return real(name, options, **kw)

    monkeypatch.setattr(MoEEmbedder, "from_pretrained", recording)
    argv = ["search", "--embeddings", str(out), "--texts", str(corpus), "--query", TEXTS[0], "-k", "1"]
    assert main(argv) == 0
    assert seen == ["bfloat16"]


def test_bad_out_paths_are_refused_before_the_model_loads(
    tmp_path, corpus, tiny_model_dir, monkeypatch, capsys
):
    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr(MoEEmbedder, "from_pretrained", no_loading)
    (tmp_path / "dir.npy").mkdir()
    (tmp_path / "plain").write_text("a file, not a directory")
    argv = ["embed", str(corpus), "--model", tiny_model_dir, "--out"]
    assert main([*argv, str(tmp_path / "dir.npy")]) == 2
    assert "dir.npy is a directory" in capsys.readouterr().err
    assert main([*argv, str(tmp_path / "plain" / "e.npy")]) == 2
    err = capsys.readouterr().err
    assert "cannot write" in err and "plain" in err
    (tmp_path / "old.npy").write_bytes(b"precious")
    assert main([*argv, str(tmp_path / "old.npy")]) == 2
    assert "old.npy already exists; pass --overwrite" in capsys.readouterr().err
    assert (tmp_path / "old.npy").read_bytes() == b"precious"
    assert main([*argv, str(tmp_path / "plain"), "--sharded"]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err
    monkeypatch.undo()
    assert main([*argv, str(tmp_path / "old.npy"), "--overwrite"]) == 0
    assert read_embeddings(tmp_path / "old.npy")[0].shape == (len(TEXTS), 80)


def test_merge_refuses_to_overwrite(tmp_path, corpus, tiny_model_dir, capsys):
    out_dir = tmp_path / "shards"
    assert main(["embed", str(corpus), "--model", tiny_model_dir, "--out", str(out_dir), "--sharded"]) == 0
    target = tmp_path / "merged.npy"
    target.write_bytes(b"precious")
    assert main(["embed", "--merge", str(out_dir), "--out", str(target)]) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert main(["embed", "--merge", str(out_dir), "--out", str(target), "--overwrite"]) == 0
    np.testing.assert_array_equal(np.load(target), np.load(out_dir / "embeddings.npy"))


@pytest.mark.slow
def test_truncated_texts_of_every_chunk_are_counted_in_the_sidecar(tmp_path, tiny_model_dir, capsys):
    long = " ".join(["cat"] * 600)  # longer than the tiny model's 512 positions
    corpus = tmp_path / "long.txt"
    corpus.write_text("\n".join([long, "rain", long, "sun", long]) + "\n")
    out = tmp_path / "e.npy"
    # chunks of 2: the same warning in chunks 1 and 2 would be shown once by Python's warning filter
    assert (
        main(["embed", str(corpus), "--model", tiny_model_dir, "--out", str(out), "--chunk-size", "2"]) == 0
    )
    assert read_embeddings(out)[1]["truncated_texts"] == 3
    assert "3 of 5 texts were truncated" in capsys.readouterr().err
    shards = tmp_path / "shards"
    argv = [
        "embed",
        str(corpus),
        "--model",
        tiny_model_dir,
        "--out",
        str(shards),
        "--sharded",
        "--chunk-size",
        "1",
    ]
    assert main([*argv, "--num-shards", "2", "--shard-rank", "1", "--no-merge"]) == 0
    assert main([*argv, "--num-shards", "2", "--shard-rank", "0"]) == 0
    assert read_embeddings(shards / "embeddings.npy")[1]["truncated_texts"] == 3


def test_search_output_escapes_control_characters(tmp_path, tiny_model_dir, capsys):
    corpus = tmp_path / "c.jsonl"
    nasty = "red \x1b[31malert\x1b[0m bell\x07 two\nlines \u202eevil"
    corpus.write_text("\n".join(json.dumps({"text": t}) for t in [nasty, "rain at night"]) + "\n")
    emb = tmp_path / "c.npy"
    assert main(["embed", str(corpus), "--model", tiny_model_dir, "--out", str(emb)]) == 0
    capsys.readouterr()
    argv = ["search", "--embeddings", str(emb), "--texts", str(corpus), "--query", nasty, "-k", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out
    assert len(out.splitlines()) == 3  # the query line and one line per hit
    assert "red \\x1b[31malert" in out
    assert main([*argv, "--json"]) == 0  # JSON escapes them itself, and keeps the text exact
    assert json.loads(capsys.readouterr().out)["results"][0]["text"] == nasty


def test_search_embeds_queries_with_every_recorded_field(tmp_path, corpus, tiny_model_dir, capsys):
    """The recipe options are part of the recorded configuration: a corpus text used as the query
    finds itself with similarity 1 (a query embedded without the recipe would not)."""
    emb = tmp_path / "echo.npy"
    flags = ["--method", "hs", "--recipe", "echo", "--hs-layer", "0", "--pooling", "mean"]
    assert main(["embed", str(corpus), "--model", tiny_model_dir, "--out", str(emb), *flags]) == 0
    capsys.readouterr()
    argv = [
        "search",
        "--embeddings",
        str(emb),
        "--texts",
        str(corpus),
        "--query",
        TEXTS[1],
        "-k",
        "1",
        "--json",
    ]
    assert main(argv) == 0
    hit = json.loads(capsys.readouterr().out)["results"][0]
    assert hit["id"] == 1 and hit["score"] == pytest.approx(1.0, abs=1e-5)


class _Terminal:
    """A stand-in stderr that says it is a terminal (tqdm shows its bar only there by default)."""

    def __init__(self) -> None:
        self.parts: list[str] = []

    def write(self, text: str) -> int:
        self.parts.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return True

    @property
    def text(self) -> str:
        return "".join(self.parts)


@pytest.mark.parametrize(
    "tty, flag, shown", [(True, None, True), (True, "--no-progress", False), (False, None, False)]
)
def test_embed_shows_texts_done_of_total_on_a_terminal(
    tmp_path, corpus, tiny_model_dir, monkeypatch, capsys, tty, flag, shown
):
    """A long run shows a tqdm bar (texts done / total) on stderr; --no-progress or a stderr that is
    not a terminal (a log file, a pipe) turns it off."""
    import io
    import sys

    err = _Terminal() if tty else io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    argv = ["embed", str(corpus), "--model", tiny_model_dir, "--out", str(tmp_path / "e.npy")]
    argv += ["--device", "cpu", "--chunk-size", "4", "--batch-size", "2", *([flag] if flag else [])]
    assert main(argv) == 0
    written = err.text if tty else err.getvalue()
    assert (f"{len(TEXTS)}/{len(TEXTS)}" in written) is shown
    assert ("embedding" in written) is shown
    assert "moee embed: wrote" in written  # the log line is there either way
