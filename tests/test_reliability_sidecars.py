"""What `moee embed`, `fit-reference` and `search` record about their inputs, and what they refuse:
queries embedded exactly like the corpus, texts, index, sidecar, reference and weights checked by
digest, existing outputs kept without --overwrite, one writer per output, inputs checked first."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import moee
from moee.cli import main
from moee.embed.embedder import MoEEmbedder
from moee.embed.reference import Reference, reference_paths
from moee.io import read_embeddings, read_metadata, sidecar_path, texts_digest

ROOT = Path(moee.__file__).resolve().parents[1]
TEXTS = [
    "the cat sat on the mat",
    "a dog ran under the tree",
    "music and science",
    'the "big" red house',
    "the sun over the river",
    "rain at night",
    "a bird in the garden",
]


@pytest.fixture()
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(TEXTS) + "\n")
    return path


@pytest.fixture()
def model_dir(tiny_model_dir, tmp_path):
    """A private copy of the tiny model (some tests change its weights)."""
    return str(shutil.copytree(tiny_model_dir, tmp_path / "model"))


def _embed(corpus, out, model, *flags):
    return main(["embed", str(corpus), "--model", str(model), "--out", str(out), "--device", "cpu", *flags])


def _search(emb, corpus, query, *flags):
    argv = ["search", "--embeddings", str(emb), "--texts", str(corpus), "--query", query, "--json"]
    return main([*argv, "--device", "cpu", *flags])


def _hits(capsys):
    return json.loads(capsys.readouterr().out.splitlines()[-1])["results"]


def _fit(corpus, out, model, *flags):
    return main(
        ["fit-reference", str(corpus), "--out", str(out), "--model", str(model), "--device", "cpu", *flags]
    )


# --------------------------------------------------------------------------- the query's configuration
@pytest.mark.parametrize(
    "flags",
    [
        ["--recipe", "echo"],
        ["--recipe", "token_prepending", "--prompt", "prompteol"],
        ["--method", "hs", "--hs-layer", "0"],
        ["--method", "rw", "--rw-layers", "0:0.25,1:2"],
        ["--reference", "REF"],
    ],
    ids=["echo", "token_prepending", "hs_layer", "weighted_rw_layers", "reference"],
)
def test_search_scores_a_corpus_row_at_one_under_the_corpus_configuration(
    tmp_path, corpus, tiny_model_dir, capsys, flags
):
    """The query is embedded under every field the sidecar records, recipe options included: a
    corpus row's own text is its first hit with cosine 1 (a query embedded without them scores less)."""
    if "REF" in flags:
        assert _fit(corpus, tmp_path / "ref", tiny_model_dir, "--prompt", "prompteol") == 0
        flags = ["--reference", str(tmp_path / "ref.safetensors"), "--prompt", "prompteol"]
    emb = tmp_path / "e.npy"
    assert _embed(corpus, emb, tiny_model_dir, *flags) == 0
    capsys.readouterr()
    for row in (0, 4):
        assert _search(emb, corpus, TEXTS[row], "-k", "2") == 0
        first = _hits(capsys)[0]
        assert first["id"] == row and first["score"] == pytest.approx(1.0, abs=1e-5)


# --------------------------------------------------------------------------- texts, index, sidecar
def test_search_refuses_texts_that_are_not_the_embedded_ones(tmp_path, corpus, tiny_model_dir, capsys):
    emb = tmp_path / "e.npy"
    assert _embed(corpus, emb, tiny_model_dir, "--method", "hs") == 0
    assert read_metadata(emb)["texts_sha256"] == texts_digest(TEXTS)[0]
    shuffled = tmp_path / "shuffled.txt"
    shuffled.write_text("\n".join(reversed(TEXTS)) + "\n")  # the same row count
    capsys.readouterr()
    assert _search(emb, shuffled, TEXTS[0]) == 2
    err = capsys.readouterr().err
    assert f"--texts {shuffled} are not the texts {emb} was embedded from" in err and "reordered" in err
    assert _search(emb, corpus, TEXTS[0]) == 0  # the right corpus


def test_search_refuses_an_index_built_from_other_embeddings(tmp_path, corpus, tiny_model_dir, capsys):
    other = tmp_path / "other.txt"
    other.write_text("\n".join(t[::-1] for t in TEXTS) + "\n")  # another corpus, the same shape
    a, b = tmp_path / "a.npy", tmp_path / "b.npy"
    assert _embed(corpus, a, tiny_model_dir) == 0 and _embed(other, b, tiny_model_dir) == 0
    index = tmp_path / "a.faiss"
    assert _search(a, corpus, TEXTS[0], "--save-index", str(index)) == 0
    capsys.readouterr()
    assert _search(b, other, TEXTS[0], "--load-index", str(index)) == 2
    err = capsys.readouterr().err
    assert f"index {index} was built from other embeddings ({a.resolve()}) than {b}" in err
    assert _search(a, corpus, TEXTS[0], "--load-index", str(index)) == 0


def test_save_index_refuses_an_existing_index_before_the_model_loads(
    tmp_path, corpus, tiny_model_dir, capsys, monkeypatch
):
    emb, index = tmp_path / "e.npy", tmp_path / "e.faiss"
    assert _embed(corpus, emb, tiny_model_dir) == 0
    assert _search(emb, corpus, TEXTS[0], "--save-index", str(index)) == 0
    before = index.read_bytes()
    monkeypatch.setattr(MoEEmbedder, "from_pretrained", lambda *a, **k: pytest.fail("the model was loaded"))
    capsys.readouterr()
    assert _search(emb, corpus, TEXTS[0], "--save-index", str(index), "--index-type", "ivf") == 2
    assert f"--save-index {index} already exists; pass --overwrite" in capsys.readouterr().err
    assert index.read_bytes() == before
    monkeypatch.undo()
    assert _search(emb, corpus, TEXTS[0], "--save-index", str(index), "--overwrite") == 0


def test_search_refuses_an_edited_sidecar(tmp_path, corpus, tiny_model_dir, capsys):
    emb = tmp_path / "e.npy"
    assert _embed(corpus, emb, tiny_model_dir, "--alpha", "1") == 0
    sidecar = sidecar_path(emb)
    text = sidecar.read_text()
    assert '"alpha": 1.0' in text
    sidecar.write_text(text.replace('"alpha": 1.0', '"alpha": 9.0'))
    capsys.readouterr()
    assert _search(emb, corpus, TEXTS[0]) == 2
    assert "e.npy.json was changed after it was written" in capsys.readouterr().err


def test_search_refuses_a_model_whose_weights_changed(tmp_path, corpus, model_dir, capsys):
    from moee.capture.tiny import tiny_model

    emb = tmp_path / "e.npy"
    assert _embed(corpus, emb, model_dir) == 0
    recorded = read_metadata(emb)["weights_digest"]
    torch = pytest.importorskip("torch")
    torch.manual_seed(7)
    changed = tiny_model("olmoe", n_layers=2)
    with torch.no_grad():
        for p in changed.parameters():
            p.add_(0.01 * torch.randn_like(p))
    changed.save_pretrained(model_dir)  # the same path, other weights
    capsys.readouterr()
    assert _search(emb, corpus, TEXTS[0]) == 2
    err = capsys.readouterr().err
    assert f"but {emb} was embedded with weights {recorded}" in err and "the model changed" in err


# --------------------------------------------------------------------------- references
def test_fit_reference_refuses_an_existing_reference_and_search_a_refitted_one(
    tmp_path, corpus, tiny_model_dir, capsys, monkeypatch
):
    ref = tmp_path / "ref"
    assert _fit(corpus, ref, tiny_model_dir) == 0
    tensors, sidecar = reference_paths(ref)
    emb = tmp_path / "e.npy"
    assert _embed(corpus, emb, tiny_model_dir, "--reference", str(tensors)) == 0
    recorded = read_metadata(emb)["reference_sha256"]
    assert recorded == json.loads(sidecar.read_text())["sha256"]
    before = tensors.read_bytes()
    monkeypatch.setattr(MoEEmbedder, "from_pretrained", lambda *a, **k: pytest.fail("the model was loaded"))
    capsys.readouterr()
    assert _fit(corpus, ref, tiny_model_dir) == 2  # refused before any work
    assert "already exists; pass --overwrite" in capsys.readouterr().err and tensors.read_bytes() == before
    monkeypatch.undo()
    half = tmp_path / "half.txt"
    half.write_text("\n".join(TEXTS[:4]) + "\n")
    assert _fit(half, ref, tiny_model_dir, "--overwrite") == 0  # re-fit under the same path
    capsys.readouterr()
    assert _search(emb, corpus, TEXTS[0]) == 2
    err = capsys.readouterr().err
    assert f"reference {tensors} changed since {emb} was embedded with it" in err and recorded in err


def test_a_reference_sidecar_without_its_sha256_is_refused(tmp_path, tiny_embedder):
    path = tiny_embedder.fit_reference(TEXTS, tmp_path / "ref")
    sidecar = reference_paths(path)[1]
    meta = json.loads(sidecar.read_text())
    assert len(meta["sidecar_sha256"]) == 64
    sidecar.write_text(json.dumps({k: v for k, v in meta.items() if k not in ("sha256", "sidecar_sha256")}))
    with pytest.raises(ValueError, match="has no sha256 of its statistics"):
        Reference.load(path)
    edited = {**meta, "n_texts": 99}  # any edit of a sealed reference sidecar is refused
    sidecar.write_text(json.dumps(edited))
    with pytest.raises(ValueError, match="was changed after it was written"):
        Reference.load(path)


def test_fit_reference_on_no_texts_is_a_clear_error(tmp_path, tiny_embedder):
    with pytest.raises(ValueError, match="a reference needs at least 2 texts .*got 0"):
        tiny_embedder.fit_reference([], tmp_path / "ref")
    with pytest.raises(ValueError, match="got 1"):
        Reference.fit(np.zeros((1, 4)), np.zeros((1, 2, 3)), {})
    assert not any(tmp_path.iterdir())


def test_references_are_written_with_the_normal_file_mode(tmp_path, tiny_embedder):
    old = os.umask(0o022)
    try:
        path = tiny_embedder.fit_reference(TEXTS, tmp_path / "ref")
    finally:
        os.umask(old)
    for file in reference_paths(path):
        assert oct(file.stat().st_mode & 0o777) == oct(0o644), file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ref.json", "ref.safetensors"]


# --------------------------------------------------------------------------- checks before work
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--method", "hs", "--hs-layer", "5"],
            "hs_layer 5 is out of range for a model with 2 decoder layers",
        ),
        (
            ["--method", "rw", "--rw-layers", "0,3"],
            "rw_layers index 3 is out of range for a model with 2 MoE",
        ),
    ],
)
@pytest.mark.parametrize("command", ["embed", "fit-reference"])
def test_out_of_range_layers_are_refused_before_any_text_is_embedded(
    tmp_path, corpus, tiny_model_dir, capsys, monkeypatch, flags, message, command
):
    monkeypatch.setattr(MoEEmbedder, "_trace", lambda *a, **k: pytest.fail("a text was embedded"))
    if command == "fit-reference":
        flags = [f for f in flags if f not in ("--method", "hs", "rw")]
        assert _fit(corpus, tmp_path / "ref", tiny_model_dir, *flags) == 2
    else:
        assert _embed(corpus, tmp_path / "e.npy", tiny_model_dir, *flags) == 2
    assert message in capsys.readouterr().err
    assert not any(p.name != "corpus.txt" for p in tmp_path.iterdir())


def test_a_bad_row_anywhere_in_the_input_is_found_before_the_model_loads(tmp_path, monkeypatch, capsys):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "a"}\n' * 5 + '{"txt": "b"}\n')
    monkeypatch.setattr(MoEEmbedder, "from_pretrained", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["embed", str(path), "--out", str(tmp_path / "e.npy")]) == 2
    assert "c.jsonl:6: no field 'text'" in capsys.readouterr().err


def test_an_unknown_model_name_is_a_clear_offline_error(tmp_path, corpus, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert (
        main(["embed", str(corpus), "--model", "no-such-org/no-such-model", "--out", str(tmp_path / "e.npy")])
        == 2
    )
    err = capsys.readouterr().err
    assert "model 'no-such-org/no-such-model' is not a local directory, and the Hub is offline" in err
    assert "Traceback" not in err


# --------------------------------------------------------------------------- progress
def test_embed_progress_counts_texts_against_a_total(tmp_path, corpus, tiny_model_dir, monkeypatch):
    import tqdm.auto

    bars = []

    class Recording:
        def __init__(self, iterable=None, *args, total=None, desc=None, **kwargs):
            self.iterable, self.total, self.n, self.updates = iterable, total, 0, []
            if desc == "embedding":
                bars.append(self)

        def __iter__(self):
            return iter(self.iterable)

        def update(self, n=1):
            self.n += n
            self.updates.append(n)

        def close(self):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(tqdm.auto, "tqdm", Recording)
    assert _embed(corpus, tmp_path / "e.npy", tiny_model_dir, "--batch-size", "2") == 0
    (bar,) = bars  # one bar for the run, moved by the batches inside the one chunk
    assert bar.total == len(TEXTS) and bar.n == len(TEXTS)
    assert [u for u in bar.updates if u] == [2, 2, 2, 1]


# --------------------------------------------------------------------------- concurrent runs
def _env():
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def test_a_second_embed_to_an_output_being_written_is_refused_at_once(
    tmp_path, corpus, tiny_model_dir, capsys
):
    """Another process holds --out's lock (as a running `moee embed` does): this run is refused
    before the model loads, and the other's output is not touched."""
    out = tmp_path / "e.npy"
    holder = subprocess.Popen(
        [sys.executable, "-c", f"from moee.io import output_lock\nwith output_lock({str(out)!r}):\n input()"],
        stdin=subprocess.PIPE,
        env=_env(),
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / ".e.npy.lock").exists() or not (tmp_path / ".e.npy.lock").read_text():
            assert time.monotonic() < deadline and holder.poll() is None
            time.sleep(0.1)
        assert _embed(corpus, out, tiny_model_dir, "--overwrite") == 2
        assert f"(pid {holder.pid}) is writing --out {out}" in capsys.readouterr().err
        assert not out.exists()
    finally:
        holder.communicate("\n", timeout=60)
    assert _embed(corpus, out, tiny_model_dir) == 0  # released: the next run writes it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "e.npy", "e.npy.json"]


@pytest.mark.slow
def test_two_concurrent_embed_runs_to_one_output_never_mix_their_rows(tmp_path, corpus, tiny_model_dir):
    """Two processes started together on different inputs, one --out: each either writes a
    complete pair of its own rows or is refused; the pair left describes its own rows."""
    other = tmp_path / "other.txt"
    other.write_text("\n".join(t.upper() for t in TEXTS * 40) + "\n")
    out = tmp_path / "e.npy"
    runs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "moee.cli",
                "embed",
                str(src),
                "--model",
                tiny_model_dir,
                "--out",
                str(out),
            ]
            + ["--overwrite", "--device", "cpu", "--batch-size", "4", "--chunk-size", "8"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=_env(),
            text=True,
        )
        for src in (corpus, other)
    ]
    results = [(run.wait(timeout=300), run.communicate()[1]) for run in runs]
    assert all(rc in (0, 2) for rc, _ in results), results
    assert any(rc == 0 for rc, _ in results), results
    for rc, err in results:
        if rc == 2:
            assert "is writing --out" in err, err
    arr, meta = read_embeddings(out)  # the data hash matches: one writer's complete rows
    source = corpus if meta["input"] == str(corpus.resolve()) else other
    texts = source.read_text().splitlines()
    assert meta["texts_sha256"] == texts_digest(texts)[0] and arr.shape[0] == len(texts)
    expected = MoEEmbedder.from_pretrained(tiny_model_dir, device="cpu").encode(texts[:8])
    np.testing.assert_allclose(arr[:8], expected, atol=1e-5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "e.npy", "e.npy.json", "other.txt"]
