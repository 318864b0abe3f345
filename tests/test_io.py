"""Streaming readers (.txt/.jsonl/.parquet) and embedding files with sidecars."""

import json
import os
import shlex
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moee.io import (
    EmbeddingWriter,
    batched,
    input_format,
    npy_shape,
    read_embeddings,
    read_metadata,
    read_texts,
    run_metadata,
    seal,
    sidecar_path,
    texts_digest,
    write_embeddings,
)


def test_txt_lines_blank_lines_kept_and_crlf(tmp_path):
    p = tmp_path / "a.txt"
    p.write_bytes(b"first\r\n\nthird has \xe2\x80\xa8 a separator\n  spaced  \nlast")
    assert list(read_texts(p)) == ["first", "", "third has \u2028 a separator", "  spaced  ", "last"]
    p.write_text("one\ntwo\n")
    assert list(read_texts(p)) == ["one", "two"]  # the final newline ends a line, it adds no row


def test_txt_is_lazy(tmp_path):
    p = tmp_path / "a.txt"
    p.write_bytes(b"x\n" * 10 + b"\xff\n")  # a bad line at the end is not reached by the first items
    it = read_texts(p)
    assert [next(it) for _ in range(10)] == ["x"] * 10
    with pytest.raises(ValueError, match=r"a.txt:11: not valid UTF-8"):
        next(it)


def test_empty_files_are_errors(tmp_path):
    for name in ("e.txt", "e.jsonl"):
        (tmp_path / name).write_text("")
        with pytest.raises(ValueError, match="is empty"):
            list(read_texts(tmp_path / name))
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "e.parquet")
    with pytest.raises(ValueError, match="is empty"):
        list(read_texts(tmp_path / "e.parquet"))


def test_jsonl(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text('{"text": "a", "id": 1}\n{"text": "", "id": 2}\n{"body": "x", "text": "c"}\n')
    assert list(read_texts(p)) == ["a", "", "c"]
    p.write_text('{"body": "x"}\n{"body": "y"}\n')
    assert list(read_texts(p, field="body")) == ["x", "y"]


@pytest.mark.parametrize(
    "content,match",
    [
        ('{"text": "a"}\n\n{"text": "b"}\n', r"a.jsonl:2: blank line"),
        ('{"text": "a"}\n{"body": "b"}\n', r"a.jsonl:2: no field 'text' \(keys: 'body'\)"),
        ('{"text": "a"}\n{"text": None}\n', r"a.jsonl:2: invalid JSON"),
        ('["a"]\n', r"a.jsonl:1: expected a JSON object, got list"),
    ],
)
def test_jsonl_errors_name_the_line(tmp_path, content, match):
    p = tmp_path / "a.jsonl"
    p.write_text(content)
    with pytest.raises(ValueError, match=match):
        list(read_texts(p))


def test_jsonl_non_string_value(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text('{"text": "a"}\n{"text": null}\n')
    with pytest.raises(TypeError, match=r"a.jsonl:2: field 'text' must be a string, got NoneType"):
        list(read_texts(p))


def test_parquet_batchwise(tmp_path):
    p = tmp_path / "a.parquet"
    texts = [f"t{i}" for i in range(20_000)]
    pq.write_table(pa.table({"text": texts, "n": list(range(20_000))}), p, row_group_size=3000)
    assert list(read_texts(p)) == texts
    with pytest.raises(ValueError, match=r"no column 'body' \(columns: text, n\)"):
        list(read_texts(p, field="body"))
    with pytest.raises(TypeError, match="column 'n' must hold strings"):
        list(read_texts(p, field="n"))
    pq.write_table(pa.table({"text": ["a", None]}), p)
    with pytest.raises(ValueError, match="row 1 of column 'text' is null"):
        list(read_texts(p))


def test_format_and_missing_files(tmp_path):
    assert input_format("x.TXT") == "txt" and input_format("x.ndjson") == "jsonl"
    with pytest.raises(ValueError, match="unsupported input file type '.csv'"):
        read_texts(tmp_path / "x.csv")
    with pytest.raises(FileNotFoundError, match="input file not found"):
        read_texts(tmp_path / "missing.txt")
    (tmp_path / "a.txt").write_text("a\n")
    with pytest.raises(ValueError, match="field applies to .jsonl and .parquet"):
        read_texts(tmp_path / "a.txt", field="text")


def test_batched():
    assert list(batched(range(7), 3)) == [[0, 1, 2], [3, 4, 5], [6]]
    assert list(batched([], 3)) == []


def test_write_and_read_embeddings(tmp_path):
    emb = np.random.default_rng(0).normal(size=(5, 3))
    meta = {"model": "m", "method": "moee_sum", "alpha": 1.0, **run_metadata(["moee", "embed", "a b.txt"])}
    path = write_embeddings(tmp_path / "e.npy", emb, meta)
    arr, got = read_embeddings(path)
    np.testing.assert_array_equal(arr, emb.astype(np.float32))
    assert arr.dtype == np.float32
    assert got["shape"] == [5, 3] and got["array_dtype"] == "float32" and got["model"] == "m"
    assert got["command"] == "moee embed 'a b.txt'"
    assert set(got["versions"]) >= {"torch", "transformers", "moee", "numpy"}
    assert got["timestamp"].endswith("+00:00")
    assert sidecar_path(path).name == "e.npy.json"
    assert np.load(path, allow_pickle=False).shape == (5, 3)


def test_streaming_writer(tmp_path):
    rng = np.random.default_rng(0)
    parts = [rng.normal(size=(n, 4)).astype(np.float32) for n in (3, 0, 1000, 7)]
    with EmbeddingWriter(tmp_path / "s.npy") as w:
        for part in parts:
            w.write(part)
        assert not (tmp_path / "s.npy").exists()  # only the .partial exists until close
    arr, meta = read_embeddings(tmp_path / "s.npy", mmap=True)
    np.testing.assert_array_equal(arr, np.concatenate(parts))
    assert npy_shape(tmp_path / "s.npy") == (1010, 4)
    # an empty result is still a valid file
    w = EmbeddingWriter(tmp_path / "z.npy", dim=8)
    w.close({})
    assert np.load(tmp_path / "z.npy").shape == (0, 8)


def test_writer_aborts_on_error(tmp_path):
    with pytest.raises(ValueError, match="dimension 5, earlier rows had 4"):
        with EmbeddingWriter(tmp_path / "s.npy") as w:
            w.write(np.zeros((2, 4)))
            w.write(np.zeros((2, 5)))
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="written as .npy"):
        EmbeddingWriter(tmp_path / "s.bin")


def test_read_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="embeddings file not found"):
        read_embeddings(tmp_path / "none.npy")
    np.save(tmp_path / "bare.npy", np.zeros((2, 2), np.float32))
    with pytest.raises(FileNotFoundError, match="sidecar .* is missing"):
        read_embeddings(tmp_path / "bare.npy")
    path = write_embeddings(tmp_path / "e.npy", np.zeros((2, 2)), {})
    sidecar = sidecar_path(path)
    sidecar.write_text(json.dumps(seal({**read_metadata(path), "shape": [3, 2]})))  # consistent, but wrong
    with pytest.raises(ValueError, match="does not match its sidecar: 144 bytes, expected 152"):
        read_embeddings(path)
    with pytest.raises(ValueError, match="sidecar says"):
        read_embeddings(path, verify=False)
    sidecar.write_text("{}")
    with pytest.raises(ValueError, match="not a moee embeddings sidecar"):
        read_metadata(path)


def test_run_metadata_defaults_to_argv():
    assert run_metadata()["command"] == shlex.join(sys.argv)
    assert "python" in run_metadata([])["versions"]


def test_sidecar_records_a_content_hash_checked_on_read(tmp_path):
    path = write_embeddings(tmp_path / "e.npy", np.arange(12, dtype=np.float32).reshape(4, 3), {"model": "m"})
    meta = read_metadata(path)
    assert len(meta["data_sha256"]) == 64
    with open(path, "r+b") as f:  # flip one byte of the data, as a bad disk or a stray write would
        f.seek(-5, os.SEEK_END)
        byte = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ValueError, match=r"e.npy does not match its sidecar \(content hash"):
        read_embeddings(path)
    with pytest.raises(ValueError, match="content hash"):
        read_embeddings(path, mmap=True)
    assert read_embeddings(path, verify=False)[0].shape == (4, 3)


def test_a_crash_between_the_two_renames_never_pairs_new_data_with_the_old_sidecar(tmp_path, monkeypatch):
    import moee.io as io_module

    path = write_embeddings(
        tmp_path / "e.npy", np.zeros((2, 3), np.float32), {"model": "old", "method": "hs"}
    )
    real_replace = os.replace

    def crash_on_sidecar(src, dst):
        if str(dst).endswith(".npy.json"):
            raise OSError("simulated crash")
        real_replace(src, dst)

    monkeypatch.setattr(io_module.os, "replace", crash_on_sidecar)
    with pytest.raises(OSError, match="simulated crash"):
        write_embeddings(path, np.ones((2, 3), np.float32), {"model": "new", "method": "rw"})
    monkeypatch.undo()
    with pytest.raises((FileNotFoundError, ValueError), match="sidecar"):
        read_embeddings(path)  # new rows under the old settings would be a silent wrong answer


def test_model_dtype_and_array_dtype_are_separate_fields(tmp_path):
    path = write_embeddings(tmp_path / "e.npy", np.zeros((2, 3)), {"model": "m", "model_dtype": "bfloat16"})
    meta = read_metadata(path)
    assert meta["model_dtype"] == "bfloat16" and meta["array_dtype"] == "float32"
    assert "dtype" not in meta


def test_a_directory_named_like_a_file_is_reported_as_a_directory(tmp_path):
    (tmp_path / "corpus.txt").mkdir()
    with pytest.raises(IsADirectoryError, match=r"corpus.txt is a directory, not a \.txt file"):
        read_texts(tmp_path / "corpus.txt")
    (tmp_path / "e.npy").mkdir()
    with pytest.raises(IsADirectoryError, match=r"e.npy is a directory"):
        read_embeddings(tmp_path / "e.npy")


def test_an_edited_sidecar_setting_is_refused_by_its_content_digest(tmp_path):
    path = write_embeddings(
        tmp_path / "e.npy", np.eye(2, 3, dtype=np.float32), {"method": "moee_sum", "alpha": 1.0}
    )
    sidecar = sidecar_path(path)
    meta = json.loads(sidecar.read_text())
    assert meta["format"] == "moee-embeddings/3" and len(meta["sidecar_sha256"]) == 64
    sidecar.write_text(sidecar.read_text().replace('"alpha": 1.0', '"alpha": 9.0'))
    with pytest.raises(
        ValueError, match=r"e.npy.json was changed after it was written .*re-run `moee embed`"
    ):
        read_embeddings(path)
    del meta["sidecar_sha256"]  # removing the digest does not make an edit pass either
    sidecar.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="has no sidecar_sha256"):
        read_metadata(path)


def test_a_sidecar_of_the_previous_format_is_read_with_a_warning(tmp_path):
    path = write_embeddings(tmp_path / "e.npy", np.eye(2, 3, dtype=np.float32), {"method": "hs"})
    meta = json.loads(sidecar_path(path).read_text())
    old = {k: v for k, v in meta.items() if k != "sidecar_sha256"} | {"format": "moee-embeddings/2"}
    sidecar_path(path).write_text(json.dumps(old))
    with pytest.warns(UserWarning, match="older moee .*cannot be checked"):
        arr, got = read_embeddings(path)
    assert got["method"] == "hs" and arr.shape == (2, 3)


def test_texts_digest_depends_on_order_and_content_only():
    a = texts_digest(["x", "y", ""])
    assert a[1] == 3 and a == texts_digest(iter(["x", "y", ""]))
    assert (
        a != texts_digest(["y", "x", ""]) and a != texts_digest(["xy", ""]) and a != texts_digest(["x", "y"])
    )


def test_a_second_writer_of_one_output_is_refused_while_the_first_writes(tmp_path):
    """Two writers of one output never share a temporary file, and a second one is refused at once
    (here from another process) instead of mixing rows; the first commits its own rows."""
    import subprocess
    import textwrap

    out = tmp_path / "e.npy"
    first = EmbeddingWriter(out)
    first.write(np.ones((2, 3), np.float32))
    code = textwrap.dedent(f"""
        import numpy as np
        from moee.io import OutputInUseError, write_embeddings
        try:
            write_embeddings({str(out)!r}, np.zeros((5, 3), np.float32), {{}})
        except OutputInUseError as exc:
            print("refused:", exc)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert "refused: another process" in done.stdout and "is writing" in done.stdout, done.stderr
    first.close({"who": "first"})
    arr, meta = read_embeddings(out)
    np.testing.assert_array_equal(arr, np.ones((2, 3), np.float32))
    assert meta["who"] == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.npy", "e.npy.json"]  # no lock or partial left
    second = write_embeddings(out, np.zeros((5, 3), np.float32), {"who": "second"})  # free again
    assert read_embeddings(second)[1]["who"] == "second"


def test_writers_use_unique_temporary_names(tmp_path):
    a, b = EmbeddingWriter(tmp_path / "a.npy"), EmbeddingWriter(tmp_path / "b.npy")
    assert a.partial != b.partial and a.partial.name.startswith(".a.npy.") and a.partial.suffix == ".partial"
    a.abort(), b.abort()
    first, second = EmbeddingWriter(tmp_path / "d.npy"), EmbeddingWriter(tmp_path / "d.npy")  # one thread
    first.abort()
    assert (tmp_path / ".d.npy.lock").exists()  # still held for the second writer
    second.abort()
    assert not any(tmp_path.iterdir())
    with pytest.raises(FileExistsError, match="already exists; pass --overwrite"):
        write_embeddings(write_embeddings(tmp_path / "c.npy", np.eye(2), {}), np.eye(2), {}, overwrite=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.npy", "c.npy.json"]
