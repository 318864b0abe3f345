"""`moee routes` and ``moee.analysis.routing_export``: the prompt and score resolve as at every other
entry point (flags, else the model's saved configuration, else the default) and are recorded with
the model and its weights digest; the corpus is streamed, so memory does not grow with it; the
Parquet file is sealed by its sidecar and refused when it does not check."""

from __future__ import annotations

import gc
import json
import shutil
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from moee.capture.tiny import TINY_WORDS
from moee.cli import main
from moee.embed.config import EmbeddingConfig, save_model_config
from moee.embed.embedder import MoEEmbedder

TEXTS = ["the cat sat on the mat", "a big dog ran under the tree", "music and science"]


@pytest.fixture(scope="module")
def prompted_model(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny model whose saved configuration has the PromptEOL prompt."""
    folder = tmp_path_factory.mktemp("prompted") / "model"
    shutil.copytree(tiny_model_dir, folder)
    save_model_config(EmbeddingConfig(prompt="prompteol"), folder)
    return str(folder)


def _corpus(path: Path, texts: list[str]) -> Path:
    path.write_text("\n".join(texts) + "\n", encoding="utf-8")
    return path


def _routes(model: str, corpus: Path, out: Path, *extra: str) -> int:
    return main(
        ["routes", "--model", model, "--corpus", str(corpus), "--out", str(out), "--device", "cpu", *extra]
    )


def _ids(routes) -> list[int]:
    return [int(t) for r in routes for t in r.input_ids]


def test_moee_routes_applies_the_models_saved_prompt_and_records_it(prompted_model, tmp_path, capsys):
    """With ``"prompt": "prompteol"`` in the model's configuration, `moee routes` routed the raw
    text while ``iter_token_routes``, ``trace`` and ``/v1/routing`` applied the prompt."""
    corpus = _corpus(tmp_path / "c.txt", TEXTS)
    emb = MoEEmbedder.from_pretrained(prompted_model, device="cpu")
    prompted = _ids(emb.iter_token_routes(TEXTS))  # the model's configuration: PromptEOL
    raw = _ids(emb.iter_token_routes(TEXTS, prompt=None))
    assert len(prompted) > len(raw)
    assert _routes(prompted_model, corpus, tmp_path / "r.parquet") == 0
    assert pq.read_table(tmp_path / "r.parquet").column("token_id").to_pylist() == prompted
    assert "prompt prompteol" in capsys.readouterr().out
    # recorded, in the footer and in the sealed sidecar: the configuration, the model, its weights
    from moee.analysis.routing_export import read_routing_parquet, routing_table

    table, meta = read_routing_parquet(tmp_path / "r.parquet")
    assert meta["config"] == {"prompt": "prompteol", "score": emb.default_config.score}
    assert meta["model"] == prompted_model and meta["weights_digest"] == emb.weights_digest
    assert meta["n_texts"] == len(TEXTS) and meta["n_tokens"] == table.num_rows == len(prompted)
    assert meta["command"].startswith("moee routes --model")
    footer = json.loads(pq.read_schema(tmp_path / "r.parquet").metadata[b"moee.routes"])
    assert footer["config"] == meta["config"] and footer["weights_digest"] == emb.weights_digest
    # the flags override the model's configuration, and the library follows the same rule
    assert (
        _routes(prompted_model, corpus, tmp_path / "n.parquet", "--prompt", "none", "--score", "softmax") == 0
    )
    _, meta = read_routing_parquet(tmp_path / "n.parquet")
    assert meta["config"] == {"prompt": None, "score": "softmax"}
    assert "--prompt none --score softmax" in meta["command"]  # a re-run routes the raw text too
    assert pq.read_table(tmp_path / "n.parquet").column("token_id").to_pylist() == raw
    assert routing_table(emb, TEXTS).column("token_id").to_pylist() == prompted
    with pytest.raises(SystemExit):  # a pooling or method does not apply to token routes
        _routes(prompted_model, corpus, tmp_path / "p.parquet", "--pooling", "mean")
    assert (
        _routes(prompted_model, corpus, tmp_path / "e.parquet", "--prompt", "prompteol", "--prompt", "{text}")
        == 2
    )
    assert "runs one prompt" in capsys.readouterr().err
    assert not (tmp_path / "e.parquet").exists()


@pytest.mark.slow
def test_moee_routes_memory_does_not_grow_with_the_corpus(tiny_embedder, tmp_path, monkeypatch):
    """`moee routes` held every row as Python objects (about 6.3 KB a token on the bundled model);
    it streams a batch of texts at a time into row groups, so the peak of traced memory (Python
    objects and numpy arrays) of 8 times the corpus stays within a small margin of the smaller one's."""
    import moee.analysis.routing_export as export
    import moee.provenance

    monkeypatch.setattr(export, "ROW_GROUP_ROWS", 128, raising=False)
    # the file hash reads 16 MiB blocks: a fixed cost, but larger than the rows of these corpora
    monkeypatch.setattr(moee.provenance, "_HASH_BLOCK", 1 << 16)
    monkeypatch.setattr(MoEEmbedder, "from_pretrained", classmethod(lambda cls, *a, **k: tiny_embedder))
    rng = np.random.default_rng(0)

    def peak(n_texts: int) -> tuple[int, int]:
        texts = [" ".join(rng.choice(TINY_WORDS, size=12)) for _ in range(n_texts)]
        corpus = _corpus(tmp_path / f"c{n_texts}.txt", texts)
        out = tmp_path / f"r{n_texts}.parquet"
        gc.collect()
        tracemalloc.start()
        try:
            assert _routes("tiny", corpus, out) == 0
            _, top = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        return top, pq.ParquetFile(out).metadata.num_rows

    peak(20)  # imports and first-call caches
    small, small_rows = peak(150)
    large, large_rows = peak(1200)
    assert large_rows >= 8 * small_rows > 0
    # held as Python objects, the large corpus' rows (about 15,000 more tokens) took megabytes more
    assert large - small < 500_000, (small, large)


def test_a_routes_file_is_sealed_and_refused_when_it_does_not_check(tiny_embedder, tmp_path):
    from moee.analysis.routing_export import read_routing_parquet, routing_table, write_routing_parquet

    table = routing_table(tiny_embedder, TEXTS, dense=True)
    path = write_routing_parquet(table, tmp_path / "r.parquet", metadata={"config": {"prompt": None}})
    sidecar = tmp_path / "r.parquet.json"
    rows, meta = read_routing_parquet(path)
    assert rows.equals(table) and meta["format"] == "moee-routes/1" and meta["n_tokens"] == table.num_rows
    good = sidecar.read_text()
    # an edited setting in the sidecar
    edited = json.loads(good)
    edited["config"]["prompt"] = "prompteol"
    sidecar.write_text(json.dumps(edited))
    with pytest.raises(
        ValueError, match=r"r\.parquet\.json was changed after it was written.*re-run `moee routes`"
    ):
        read_routing_parquet(path)
    # other rows under the old sidecar
    sidecar.write_text(good)
    first = table.column("layer0_weights").to_pylist()
    first[0][0] = 0.999
    pq.write_table(
        table.set_column(table.schema.get_field_index("layer0_weights"), "layer0_weights", [first]), path
    )
    with pytest.raises(ValueError, match=r"r\.parquet does not match its sidecar.*re-run `moee routes`"):
        read_routing_parquet(path)
    # a file without a sidecar (as moee routes wrote them before they were sealed)
    sidecar.unlink()
    with pytest.raises(FileNotFoundError, match=r"r\.parquet\.json is missing.*re-run `moee routes`"):
        read_routing_parquet(path)
    # nothing is left behind beside the output but the pair
    write_routing_parquet(table, tmp_path / "r.parquet")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.parquet", "r.parquet.json"]
    with pytest.raises(FileExistsError, match="already exists"):
        write_routing_parquet(table, tmp_path / "r.parquet", overwrite=False)
