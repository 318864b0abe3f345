"""Ray Data embedding (``moee.integrations.ray``, ``moee embed --engine ray``) on a local Ray cluster
started once for the module: rows equal single-process ``encode`` under their ids, a killed actor
loses or duplicates no row, bad input is named by column and row."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'moee[ray]')")
pytest.importorskip("ray.data", reason="Ray Data is not installed (pip install 'moee[ray]')")

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

import moee  # noqa: E402
from moee.capture.tiny import TINY_WORDS  # noqa: E402
from moee.cli import main  # noqa: E402
from moee.embed.embedder import MoEEmbedder  # noqa: E402
from moee.integrations.ray import MoEEmbedBatches  # noqa: E402
from moee.io import read_embeddings, read_embeddings_table  # noqa: E402

ROOT = Path(moee.__file__).resolve().parents[1]
N = 240
CONFIG = {"prompt": "prompteol", "pooling": "mean"}


@pytest.fixture(scope="module")
def cluster():
    """One small local cluster for the module (2 CPUs, a 200 MB object store, no dashboard);
    its workers import this checkout."""
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), saved]))
    kwargs = dict(num_cpus=2, object_store_memory=200 << 20, include_dashboard=False, log_to_driver=False)
    try:
        ray.init(**kwargs)
    except Exception as exc:  # a loaded machine can miss Ray's fixed 30 s raylet start-up wait once
        if "timed out during startup" not in str(exc):
            raise
        ray.shutdown()
        ray.init(**kwargs)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()
    if saved is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = saved


@pytest.fixture(scope="module")
def corpus(tiny_model_dir):
    rng = np.random.default_rng(1)
    texts = [" ".join(rng.choice(TINY_WORDS, size=int(rng.integers(0, 14)))) for _ in range(N)]
    ids = [f"doc-{i:04d}" for i in rng.permutation(N)]  # ids in no particular order
    embedder = MoEEmbedder.from_pretrained(tiny_model_dir, device="cpu")
    single = {m: embedder.encode(texts, method=m, **CONFIG) for m in ("moee_concat", "hs", "rw")}
    return texts, ids, single


def _actor_kwargs(model_dir):
    return {"model": model_dir, "load": {"device": "cpu"}, "method": "moee_concat", "batch_size": 8, **CONFIG}


def _by_id(table, column):
    vectors = np.asarray(table.column(column).to_pylist(), dtype=np.float32)
    return dict(zip(table.column("id").to_pylist(), vectors))


@pytest.mark.slow
def test_two_actors_equal_single_process_encode(cluster, corpus, tiny_model_dir):
    texts, ids, single = corpus
    ds = ray.data.from_items([{"id": i, "text": t, "lang": "en"} for i, t in zip(ids, texts)])
    out = ds.map_batches(
        MoEEmbedBatches,
        fn_constructor_kwargs={**_actor_kwargs(tiny_model_dir), "features": True},
        concurrency=2,
        num_cpus=1,
        batch_size=32,
        batch_format="pyarrow",
    )
    table = out.to_arrow_refs()
    table = pa.concat_tables(ray.get(table))
    assert set(table.column_names) == {"id", "text", "lang", "embedding", "embedding_hs", "embedding_rw"}
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), single["moee_concat"].shape[1])
    assert sorted(table.column("id").to_pylist()) == sorted(ids)  # every row once
    position = {i: n for n, i in enumerate(ids)}
    for column, method in (("embedding", "moee_concat"), ("embedding_hs", "hs"), ("embedding_rw", "rw")):
        got = _by_id(table, column)
        expected = single[method]
        worst = max(float(np.abs(v - expected[position[i]]).max()) for i, v in got.items())
        assert worst <= 1e-6, (column, worst)


@pytest.mark.slow
def test_a_killed_actor_loses_and_duplicates_no_row(cluster, corpus, tiny_model_dir, tmp_path):
    texts, ids, single = corpus
    marker = tmp_path / "crashed"

    class CrashOnce(MoEEmbedBatches):  # defined here, so Ray ships it by value
        calls = 0

        def __call__(self, batch):
            self.calls += 1
            if self.calls == 3 and not marker.exists():
                marker.touch()
                os._exit(1)  # the actor's process dies mid-run, its batch unfinished
            return super().__call__(batch)

    ds = ray.data.from_items([{"id": i, "text": t} for i, t in zip(ids, texts)], override_num_blocks=8)
    out = ds.map_batches(
        CrashOnce,
        fn_constructor_kwargs=_actor_kwargs(tiny_model_dir),
        concurrency=2,
        num_cpus=1,
        batch_size=16,
        batch_format="pyarrow",
        max_restarts=-1,
        max_task_retries=-1,
    )
    table = pa.concat_tables(ray.get(out.to_arrow_refs()))
    assert marker.exists()  # an actor really died
    assert len(table) == N and sorted(table.column("id").to_pylist()) == sorted(ids)
    position = {i: n for n, i in enumerate(ids)}
    for i, v in _by_id(table, "embedding").items():
        np.testing.assert_allclose(v, single["moee_concat"][position[i]], atol=1e-6)


def test_bad_batches_name_the_column_and_the_row(tiny_model_dir):
    embed = MoEEmbedBatches(**_actor_kwargs(tiny_model_dir))
    with pytest.raises(ValueError, match=r"column 'text' is not in the input \(columns: id, body\)"):
        embed(pa.table({"id": ["a"], "body": ["x"]}))
    with pytest.raises(
        TypeError, match=r"row 1 of the batch \(id='b'\): column 'text' must be a string, got int"
    ):
        embed({"id": np.array(["a", "b"]), "text": np.array(["fine", 7], dtype=object)})
    with pytest.raises(ValueError, match=r"row 0 of the batch \(id='a'\): column 'text' is missing or null"):
        embed(pa.table({"id": ["a"], "text": pa.array([None], pa.string())}))
    empty = embed(pa.table({"id": pa.array([], pa.string()), "text": pa.array([], pa.string())}))
    assert len(empty) == 0 and empty.schema.field("embedding").type.list_size == 80


def _write_inputs(folder, texts, ids):
    """The corpus as two JSONL files and one Parquet file (with two row groups), in that order."""
    folder.mkdir()
    cut1, cut2 = 90, 170
    for name, lo, hi in (("a.jsonl", 0, cut1), ("b.jsonl", cut1, cut2)):
        with open(folder / name, "w") as f:
            for i in range(lo, hi):
                f.write(json.dumps({"id": ids[i], "text": texts[i], "n": i}) + "\n")
    table = pa.table({"id": ids[cut2:], "text": texts[cut2:], "n": pa.array(range(cut2, N), pa.int32())})
    pq.write_table(table, folder / "c.parquet", row_group_size=40)


@pytest.mark.slow
def test_cli_engine_ray_writes_parquet_in_input_order_and_search_reads_it(
    cluster, corpus, tiny_model_dir, tmp_path, monkeypatch, capsys
):
    import moee.integrations.ray as moee_ray

    texts, ids, single = corpus
    _write_inputs(tmp_path / "in", texts, ids)
    monkeypatch.setattr(moee_ray, "PART_BYTES", 2000)  # several byte-range shares per JSONL file
    out = tmp_path / "out"
    argv = ["embed", "--engine", "ray", str(tmp_path / "in"), "--out", str(out), "--model", tiny_model_dir]
    argv += ["--method", "moee_concat", "--prompt", "prompteol", "--pooling", "mean", "--concurrency", "2"]
    argv += ["--batch-size", "8", "--id-field", "id", "--device", "cpu"]
    assert main(argv) == 0
    arr, meta = read_embeddings(out)
    np.testing.assert_allclose(arr, single["moee_concat"], atol=1e-6)
    table = read_embeddings_table(out, ["id", "text", "n"])
    assert table.column("id").to_pylist() == ids and table.column("text").to_pylist() == texts
    # the Parquet input's other column is carried (its type kept); JSON fields are not
    assert table.column("n").to_pylist() == [None] * 170 + list(range(170, N))
    assert table.schema.field("n").type == pa.int32()
    assert meta["columns"] == ["row", "id", "text", "n", "embedding"]
    assert meta["engine"] == "ray" and meta["prompt"] == "prompteol" and meta["shape"] == [N, 80]
    assert meta["weights_digest"] == MoEEmbedder.from_pretrained(tiny_model_dir).weights_digest
    assert len(meta["input"]) == 3 and "versions" in meta

    capsys.readouterr()
    assert main(["search", "--embeddings", str(out), "--query", texts[5], "-k", "1", "--json"]) == 0
    hit = json.loads(capsys.readouterr().out)["results"][0]
    assert hit["id"] == 5 and hit["text"] == texts[5]
    assert main(["embed", *argv[1:]]) == 2  # an existing output is refused without --overwrite
    # --overwrite replaces the previous run's Parquet files and keeps a user's notes and sub-folder
    parts = sorted(p.name for p in out.glob("*.parquet"))
    (out / "notes.txt").write_text("my notes")
    (out / "mine").mkdir()
    (out / "mine" / "keep.txt").write_text("keep me")
    assert main(["embed", *argv[1:], "--overwrite"]) == 0
    assert (out / "notes.txt").read_text() == "my notes" and (
        out / "mine" / "keep.txt"
    ).read_text() == "keep me"
    assert len(list(out.glob("*.parquet"))) == len(parts)  # a stale part would fail the read too: rows twice
    np.testing.assert_allclose(read_embeddings(out)[0], single["moee_concat"], atol=1e-6)


@pytest.mark.slow
def test_cli_engine_ray_names_a_bad_row(cluster, tiny_model_dir, tmp_path, capsys):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"text": "ok"}\n{"text": "fine"}\n{"text": 3}\n')
    argv = ["embed", "--engine", "ray", str(folder), "--out", str(tmp_path / "o"), "--model", tiny_model_dir]
    assert main([*argv, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "a.jsonl@byte 32 (input row 2): column 'text' must be a string, got int" in err, err[-2000:]
    pq.write_table(pa.table({"body": ["x"]}), folder / "b.parquet")
    assert main([*argv, "--device", "cpu"]) == 2
    assert "b.parquet: no column 'text' (columns: body)" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_input_files_whose_ids_differ_in_type_are_named_before_ray_starts(tmp_path, capsys):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"id": 1, "text": "one"}\n{"id": 2, "text": "two"}\n')
    pq.write_table(pa.table({"id": ["x", "y"], "text": ["three", "four"]}), folder / "b.parquet")
    argv = ["embed", "--engine", "ray", str(folder), "--out", str(tmp_path / "o"), "--model", "unused"]
    assert main([*argv, "--id-field", "id", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moee embed: error: ") and len(err.splitlines()) == 1, err[-3000:]
    assert f"{folder / 'b.parquet'}: the --id-field column 'id' differs in type" in err
    assert "holds string ids" in err and "holds int64 ids (first: 1)" in err
    assert not (tmp_path / "o").exists()


def test_input_schema_fixes_one_type_per_column_before_ray_starts(tmp_path):
    from moee.integrations.ray import _read_parts, input_schema

    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    pq.write_table(
        pa.table({"id": pa.array([1], pa.int32()), "text": ["x"], "score": pa.array([1], pa.int32())}), a
    )
    pq.write_table(pa.table({"id": [2], "text": ["y"], "score": [0.5], "row": [9], "lang": ["en"]}), b)
    schema = input_schema([a, b], "text", "id")
    # ids of any integer width are int64; a column's types are unified; an input "row" gives way
    assert schema == pa.schema(
        [
            ("row", pa.int64()),
            ("id", pa.int64()),
            ("text", pa.string()),
            ("score", pa.float64()),
            ("lang", pa.string()),
        ]
    )
    c = tmp_path / "c.parquet"
    pq.write_table(pa.table({"id": [3], "text": ["z"], "score": ["high"]}), c)
    with pytest.warns(UserWarning, match=r"input column 'score' is not carried .*c\.parquet: string"):
        assert "score" not in input_schema([a, b, c], "text", "id").names
    txt = tmp_path / "d.txt"
    txt.write_text("a line\n")
    with pytest.raises(ValueError, match=r"d\.txt: --id-field applies to \.jsonl and \.parquet inputs"):
        input_schema([a, txt], "text", "id")
    # a later JSONL row whose id has another type is named as it is read
    lines = tmp_path / "e.jsonl"
    lines.write_text('{"id": 1, "text": "p"}\n{"id": "2", "text": "q"}\n')
    schema = input_schema([lines], "text", "id")
    batch = {"path": [str(lines)], "fmt": ["jsonl"], "start": [0], "stop": [lines.stat().st_size]}
    with pytest.raises(
        TypeError, match=r"e\.jsonl@byte 23 \(input row 1\): the --id-field column 'id' holds '2'"
    ):
        _read_parts({**batch, "first_row": [-1], "row": [0]}, "text", "id", schema)


@pytest.mark.slow
def test_cli_engine_ray_names_an_empty_input_not_its_staging_folder(
    cluster, tiny_model_dir, tmp_path, capsys
):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out = tmp_path / "o"
    assert main(["embed", "--engine", "ray", str(empty), "--out", str(out), "--model", tiny_model_dir]) == 2
    err = capsys.readouterr().err
    assert f"moee embed: error: {empty} is empty: no texts to read" in err and ".tmp-" not in err, err[-2000:]
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["empty.jsonl"]


@pytest.mark.slow
def test_a_killed_driver_leaves_no_ray_process_behind():
    """kill -9 of a driver that started a local cluster (moee.integrations.ray.start_ray): every
    process of the cluster (Ray's agents above all, which otherwise wait a minute on the dead GCS)
    and the watchdog are gone within 10 s."""
    import select
    import subprocess
    import sys
    import time

    psutil = pytest.importorskip("psutil")
    script = (
        "import time, ray\n"
        "from moee.integrations.ray import start_ray\n"
        "start_ray()\n"
        "ray.get(ray.remote(num_cpus=0)(lambda: 1).remote())\n"  # a worker process too
        "print('ready', flush=True)\n"
        "time.sleep(300)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_ADDRESS": "local"}  # its own cluster
    driver = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True
    )
    tree = []
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and select.select([driver.stdout], [], [], 1)[0] == []:
            pass
        assert driver.stdout.readline().strip() == "ready", "the driver did not start its cluster in time"
        time.sleep(1)  # the agents started with the raylet
        tree = psutil.Process(driver.pid).children(recursive=True)
        names = {p.name() for p in tree}
        assert len(tree) >= 5 and any("raylet" in n for n in names), names
        driver.kill()
        driver.wait(10)
        _, alive = psutil.wait_procs(tree, timeout=10)
        assert not alive, [f"{p.pid} {p.cmdline()[:1]}" for p in alive]
    finally:
        driver.kill()
        for process in tree:
            try:
                process.kill()
            except psutil.Error:
                pass
