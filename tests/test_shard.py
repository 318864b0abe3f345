"""Sharded embedding: row selection, resume, manifest checks, merge order, and real multi-process runs."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import moee
from moee import shard
from moee.cli import main
from moee.io import read_embeddings, read_metadata, sidecar_path

ROOT = Path(moee.__file__).resolve().parents[1]
SETTINGS = {"model": "fake", "method": "hs"}


class FakeEncoder:
    """Deterministic per-text vectors (a row depends on its text only); counts texts seen."""

    def __init__(self, fail_after: int | None = None):
        self.seen = 0
        self.fail_after = fail_after

    def __call__(self, texts):
        self.seen += len(texts)
        if self.fail_after is not None and self.seen > self.fail_after:
            raise RuntimeError("simulated crash")
        out = np.zeros((len(texts), 4), np.float32)
        for i, t in enumerate(texts):
            out[i] = [len(t), sum(map(ord, t)) % 97, t.count("a"), 1.0]
        return out


@pytest.fixture()
def corpus(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("".join(f"text number {i} {'a' * (i % 5)}\n" for i in range(23)))
    return path


def _texts(path):
    return path.read_text().splitlines()


def test_shard_info_from_env_and_arguments(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert shard.shard_info() == shard.ShardInfo(rank=0, world=1, local_rank=0)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert shard.shard_info() == shard.ShardInfo(rank=3, world=4, local_rank=1)
    assert shard.shard_info(1, 2).rank == 1 and shard.shard_info(1, 2).world == 2
    with pytest.raises(ValueError, match=r"shard rank must be in \[0, 2\)"):
        shard.shard_info(2, 2)
    with pytest.raises(ValueError, match="number of shards must be >= 1"):
        shard.shard_info(0, 0)
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE='two' is not an integer"):
        shard.shard_info()
    assert shard.shard_name(3, 12) == "shard-00003-of-00012"


def _share(path, rank, world):
    return list(shard.read_own_texts(path, shard.ShardInfo(rank, world, rank), None))


def test_each_process_reads_only_its_contiguous_share(tmp_path, corpus, monkeypatch):
    texts = _texts(corpus)
    for world in (1, 2, 3, 7, 200):
        shares = [_share(corpus, r, world) for r in range(world)]
        assert [t for s in shares for t in s] == texts  # the shares tile the input, in order
    # a broken first line is never read by the last share's process (the whole file's reader fails)
    broken = tmp_path / "broken.txt"
    broken.write_bytes(b"\xff not utf-8\n" + corpus.read_bytes())
    with pytest.raises(ValueError, match="not valid UTF-8"):
        list(shard.read_own_texts(broken, shard.ShardInfo(0, 1, 0), None))
    assert _share(broken, 2, 3) == _share(corpus, 2, 3)[-len(_share(broken, 2, 3)) :]
    size = corpus.stat().st_size
    # the last share starts at about 2/3 of the file: the bytes before it are never read
    part = shard.own_part(corpus, shard.ShardInfo(2, 3, 2))
    assert part.start == 2 * size // 3 and part.stop == size


@pytest.mark.parametrize("world", [1, 2, 3, 30])
def test_shards_merge_to_the_single_process_result(tmp_path, corpus, world):
    single = shard.embed_stream(
        FakeEncoder(), iter(_texts(corpus)), tmp_path / "single.npy", {}, chunk_size=5
    )
    out_dir = tmp_path / "shards"
    for rank in range(world):  # world=30 > 23 rows: some shards are empty
        shard.embed_shard(
            FakeEncoder(),
            shard.ShardRun(corpus, out_dir, shard.ShardInfo(rank, world, rank), SETTINGS),
            chunk_size=4,
        )
    merged = shard.merge_shards(out_dir)
    assert merged == out_dir / "embeddings.npy"
    arr, meta = read_embeddings(merged)
    np.testing.assert_array_equal(arr, np.load(single))
    assert meta["shape"] == [23, 4] and meta["method"] == "hs" and meta["merged_from"]["shards"] == world
    last = shard.ShardInfo(world - 1, world, world - 1)
    side = read_metadata(out_dir / f"{last.name}.npy")
    part = shard.own_part(corpus, last)
    assert side["rows"] == {"part": [part.start, part.stop], "count": len(_share(corpus, world - 1, world))}
    assert side["complete"] is True
    manifest = json.loads((out_dir / "manifest.json").read_text())
    assert manifest["world"] == world and manifest["input"]["size"] == corpus.stat().st_size


def test_resume_skips_complete_shards_and_redoes_crashed_ones(tmp_path, corpus):
    out_dir = tmp_path / "shards"
    info0, info1 = shard.ShardInfo(0, 2, 0), shard.ShardInfo(1, 2, 1)
    shard.embed_shard(FakeEncoder(), shard.ShardRun(corpus, out_dir, info0, SETTINGS), chunk_size=4)
    with pytest.raises(RuntimeError, match="simulated crash"):
        shard.embed_shard(
            FakeEncoder(fail_after=5), shard.ShardRun(corpus, out_dir, info1, SETTINGS), chunk_size=4
        )
    assert not shard.shard_is_complete(out_dir, 1, 2)
    assert not (out_dir / "shard-00001-of-00002.npy").exists()
    with pytest.raises(ValueError, match=r"shards \[1\] of 2 are missing or incomplete"):
        shard.merge_shards(out_dir)
    with pytest.raises(TimeoutError, match=r"shards \[1\] of 2 .* not complete"):
        shard.wait_for_shards(out_dir, 2, timeout=0.2, poll=0.05)

    mtime = (out_dir / "shard-00000-of-00002.npy").stat().st_mtime_ns
    again = FakeEncoder()
    assert shard.embed_shard(again, shard.ShardRun(corpus, out_dir, info0, SETTINGS)) is None
    assert again.seen == 0  # the complete shard is not recomputed
    assert (out_dir / "shard-00000-of-00002.npy").stat().st_mtime_ns == mtime
    resumed = FakeEncoder()
    assert shard.embed_shard(resumed, shard.ShardRun(corpus, out_dir, info1, SETTINGS)) is not None
    assert resumed.seen == len(_share(corpus, 1, 2))
    np.testing.assert_array_equal(np.load(shard.merge_shards(out_dir)), FakeEncoder()(_texts(corpus)))


def test_a_shard_with_a_broken_sidecar_is_redone(tmp_path, corpus):
    out_dir = tmp_path / "shards"
    info = shard.ShardInfo(0, 1, 0)
    path = shard.embed_shard(FakeEncoder(), shard.ShardRun(corpus, out_dir, info, SETTINGS))
    meta = read_metadata(path)
    sidecar_path(path).write_text(json.dumps({**meta, "rows": {**meta["rows"], "count": 3}}))
    assert not shard.shard_is_complete(out_dir, 0, 1)
    enc = FakeEncoder()
    assert (
        shard.embed_shard(enc, shard.ShardRun(corpus, out_dir, info, SETTINGS)) is not None and enc.seen == 23
    )


def test_a_different_run_is_refused(tmp_path, corpus):
    out_dir = tmp_path / "shards"
    shard.embed_shard(FakeEncoder(), shard.ShardRun(corpus, out_dir, shard.ShardInfo(0, 2, 0), SETTINGS))
    with pytest.raises(ValueError, match=r"different run \(settings differ\)"):
        shard.embed_shard(
            FakeEncoder(),
            shard.ShardRun(corpus, out_dir, shard.ShardInfo(0, 2, 0), {**SETTINGS, "method": "rw"}),
        )
    with pytest.raises(ValueError, match=r"different run \(world differ\)"):
        shard.embed_shard(FakeEncoder(), shard.ShardRun(corpus, out_dir, shard.ShardInfo(0, 3, 0), SETTINGS))
    with corpus.open("a") as f:
        f.write("one more line\n")
    with pytest.raises(ValueError, match=r"different run \(input differ\)"):
        shard.embed_shard(FakeEncoder(), shard.ShardRun(corpus, out_dir, shard.ShardInfo(1, 2, 1), SETTINGS))


def test_merge_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a sharded embedding directory"):
        shard.merge_shards(tmp_path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        **extra,
    )
    return env


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from moee.capture.tiny import TINY_WORDS, tiny_model, tiny_tokenizer
    from moee.embed.embedder import MoEEmbedder

    model_dir = tmp_path_factory.mktemp("tiny-olmoe-shard")  # conftest's is tiny-olmoe0
    tiny_model("olmoe", n_layers=2).save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    rng = np.random.default_rng(0)  # 21 rows (odd, so the shards differ in size), varied lengths, one empty
    texts = [" ".join(rng.choice(TINY_WORDS, size=int(rng.integers(0, 12)))) for _ in range(21)]
    texts[4] = ""
    reference = MoEEmbedder.from_pretrained(model_dir, device="cpu").encode(texts, prompt="prompteol")
    return str(model_dir), texts, reference


@pytest.mark.slow
def test_accelerate_launch_two_processes_equals_single_process(tmp_path, tiny):
    model_dir, texts, reference = tiny
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(texts) + "\n")
    out_dir = tmp_path / "shards"
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    launch += ["--main_process_port", str(_free_port())]
    cmd = [*launch, "-m", "moee.cli", "embed", str(corpus), "--model", model_dir, "--out", str(out_dir)]
    cmd += ["--sharded", "--prompt", "prompteol", "--batch-size", "4", "--chunk-size", "5"]
    run = subprocess.run(cmd, env=_env(CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert shard.shard_is_complete(out_dir, 0, 2) and shard.shard_is_complete(out_dir, 1, 2)
    merged, meta = read_embeddings(out_dir / "embeddings.npy")
    np.testing.assert_allclose(merged, reference, atol=1e-5)
    assert meta["prompt"] == "prompteol" and meta["shape"] == [21, 80]

    # `moee embed --merge DIR --out OUT.npy` merges again, anywhere
    merged_to = tmp_path / "merged.npy"
    assert main(["embed", "--merge", str(out_dir), "--out", str(merged_to)]) == 0
    np.testing.assert_array_equal(np.load(merged_to), merged)
    assert read_metadata(merged_to)["merged_from"]["shards"] == 2


@pytest.mark.slow
def test_env_var_launch_resumes_after_a_crashed_rank(tmp_path, tiny):
    """Ranks started by hand (RANK/WORLD_SIZE or --shard-rank, as cluster launchers do): rank 1
    is 'lost', rank 0 times out waiting to merge; a rerun redoes only rank 1's shard and merges."""
    model_dir, texts, reference = tiny
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(texts) + "\n")
    out_dir = tmp_path / "shards"
    base = [sys.executable, "-m", "moee.cli", "embed", str(corpus), "--model", model_dir]
    base += ["--out", str(out_dir), "--sharded", "--prompt", "prompteol", "--device", "cpu"]
    run0 = dict(env=_env(RANK="0", WORLD_SIZE="2"), capture_output=True, text=True, timeout=300)
    r0 = subprocess.run([*base, "--merge-timeout", "1"], **run0)
    assert r0.returncode == 1 and "not complete" in r0.stderr, r0.stderr[-3000:]
    assert shard.shard_is_complete(out_dir, 0, 2) and not (out_dir / "embeddings.npy").exists()
    # rerun both ranks together: rank 0 skips its complete shard and merges once rank 1 is done
    log1 = (tmp_path / "rank1.log").open("w")  # a file, not a pipe: a full pipe would block rank 1
    r1 = subprocess.Popen([*base, "--shard-rank", "1", "--num-shards", "2"], env=_env(), stderr=log1)
    r0 = subprocess.run(base, **run0)
    assert r1.wait(timeout=300) == 0, (tmp_path / "rank1.log").read_text()[-3000:]
    log1.close()
    assert r0.returncode == 0, r0.stderr[-3000:]
    assert "already complete" in r0.stderr and "merged 2 shard(s)" in r0.stderr
    np.testing.assert_allclose(np.load(out_dir / "embeddings.npy"), reference, atol=1e-5)


def _two_shards(tmp_path, corpus):
    out_dir = tmp_path / "shards"
    for rank in range(2):
        shard.embed_shard(
            FakeEncoder(),
            shard.ShardRun(corpus, out_dir, shard.ShardInfo(rank, 2, rank), SETTINGS),
            chunk_size=4,
        )
    return out_dir, out_dir / "shard-00001-of-00002.npy"


def _flip_last_byte(path):
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_corrupted_shard_is_named_at_merge_and_recomputed_on_resume(tmp_path, corpus, damage):
    out_dir, bad = _two_shards(tmp_path, corpus)
    if damage == "flip":
        _flip_last_byte(bad)  # e.g. a NaN row: same size, same header
    else:
        bad.write_bytes(bad.read_bytes()[:-7])
    with pytest.raises(ValueError, match=r"shard-00001-of-00002\.npy .*(content hash|bytes, expected)"):
        shard.merge_shards(out_dir)
    assert not (out_dir / "embeddings.npy").exists()
    again = FakeEncoder()
    with pytest.warns(UserWarning, match="recomputing shard-00001-of-00002"):
        assert (
            shard.embed_shard(again, shard.ShardRun(corpus, out_dir, shard.ShardInfo(1, 2, 1), SETTINGS))
            is not None
        )
    assert again.seen == len(_share(corpus, 1, 2))  # the damaged shard is recomputed, not skipped
    merged = shard.merge_shards(out_dir)
    np.testing.assert_array_equal(read_embeddings(merged)[0], FakeEncoder()(_texts(corpus)))


def test_the_manifest_records_each_shards_content_hash(tmp_path, corpus):
    out_dir, _ = _two_shards(tmp_path, corpus)
    shard.merge_shards(out_dir)
    manifest = json.loads((out_dir / "manifest.json").read_text())
    for rank in range(2):
        name = f"shard-{rank:05d}-of-00002.npy"
        assert manifest["shards"][name] == read_metadata(out_dir / name)["data_sha256"]
    # a rerun of the same command is still the same run
    assert (
        shard.embed_shard(FakeEncoder(), shard.ShardRun(corpus, out_dir, shard.ShardInfo(0, 2, 0), SETTINGS))
        is None
    )


def test_reordered_input_rows_are_a_different_run(tmp_path, corpus):
    out_dir = tmp_path / "shards"
    shard.embed_shard(FakeEncoder(), shard.ShardRun(corpus, out_dir, shard.ShardInfo(0, 2, 0), SETTINGS))
    stat = corpus.stat()
    lines = corpus.read_text().splitlines(keepends=True)
    corpus.write_text("".join([lines[1], lines[0], *lines[2:]]))  # same size
    os.utime(corpus, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # and the same modification time
    # rank 1 reads only its own, unchanged share; rank 0's complete shard is refused on resume
    # (its share's texts changed) and the merge refuses to mix them
    shard.embed_shard(FakeEncoder(), shard.ShardRun(corpus, out_dir, shard.ShardInfo(1, 2, 1), SETTINGS))
    with pytest.raises(ValueError, match=r"different run \(input differ: the rows of shard-00000-of-00002"):
        shard.embed_shard(FakeEncoder(), shard.ShardRun(corpus, out_dir, shard.ShardInfo(0, 2, 0), SETTINGS))
    with pytest.raises(ValueError, match=r"shards disagree on the input texts \(shard-00000-of-00002\.npy"):
        shard.merge_shards(out_dir)


def test_the_merge_records_the_texts_digest_and_refuses_shards_that_disagree(tmp_path, corpus):
    from moee.io import seal, texts_digest

    out_dir, _ = _two_shards(tmp_path, corpus)
    merged = shard.merge_shards(out_dir)
    assert read_metadata(merged)["texts_sha256"] == texts_digest(_texts(corpus))[0]
    one = sidecar_path(out_dir / "shard-00001-of-00002.npy")
    meta = json.loads(one.read_text())
    one.write_text(json.dumps(seal({**meta, "weights_digest": "0123456789ab"})))  # made by another model
    with pytest.raises(ValueError, match=r"shards disagree on the model weights \(weights_digest"):
        shard.merge_shards(out_dir, tmp_path / "again.npy")
    one.write_text(json.dumps(seal({**meta, "texts_sha256": "f" * 64})))
    with pytest.raises(ValueError, match="shards disagree on the input texts"):
        shard.merge_shards(out_dir, tmp_path / "again.npy")
    assert not (tmp_path / "again.npy").exists()
    with pytest.raises(FileExistsError, match="already exists; pass --overwrite"):
        one.write_text(json.dumps(meta))
        shard.merge_shards(out_dir, overwrite=False)


def test_parquet_input_is_shared_by_row_groups_and_merges_to_parquet(tmp_path, corpus):
    """Parquet input: each process reads only its row groups; the merge can write a Parquet folder
    (row, text, embedding) that reads back in input order, with the whole input's texts digest."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from moee.io import texts_digest

    texts = _texts(corpus)
    source = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": texts}), source, row_group_size=5)  # 5 row groups
    out_dir = tmp_path / "shards"
    for rank in range(3):
        shard.embed_shard(
            FakeEncoder(), shard.ShardRun(source, out_dir, shard.ShardInfo(rank, 3, rank), SETTINGS)
        )
    counts = [read_metadata(out_dir / f"{shard.shard_name(r, 3)}.npy")["rows"] for r in range(3)]
    assert counts == [
        {"part": [0, 1], "count": 5},
        {"part": [1, 3], "count": 10},
        {"part": [3, 5], "count": 8},
    ]
    folder = shard.merge_shards(out_dir, tmp_path / "merged")
    arr, meta = read_embeddings(folder)
    np.testing.assert_array_equal(arr, FakeEncoder()(texts))
    assert meta["texts_sha256"] == texts_digest(texts)[0] and meta["shape"] == [23, 4]
    np.testing.assert_array_equal(read_embeddings(shard.merge_shards(out_dir))[0], arr)
