"""Train `MoEEForCausalLM` from a JSON config: data, schedule, eval, checkpoints, exact resume.

Config format (JSON; every section optional except `model` and `data`; unknown keys are errors),
read and checked into a frozen `moee.train_settings.TrainingConfig` (one section per object below;
its `to_dict()` is what every checkpoint saves)::

    {
      "seed": 0,                      # torch seed (init, gate noise) and data-order seed
      "threads": 2,                   # torch.set_num_threads
      "model": {...},                 # MoEEConfig keyword arguments (vocab_size defaults to the tokenizer's)
      "data": {
        "train": "build/corpus/train.jsonl",     # {"text": ...} per line
        "heldout": "build/corpus/heldout.jsonl",
        "tokenizer": "build/tokenizer",          # PreTrainedTokenizerFast directory
        "seq_len": 256,                          # tokens per training window
        "cache_dir": "build/tokens"              # flat uint16 token files (reused while inputs are unchanged)
      },
      "optim": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
                "grad_clip": 1.0, "batch_size": 16,
                "router_lr_scale": 1.0,   # router weights train at lr * router_lr_scale
                "trainable": "all"},      # or "routed": routers and routed experts only, the rest frozen
      "schedule": {"max_steps": 1000, "warmup_steps": 50, "min_lr_ratio": 0.1,
                   "time_budget_minutes": null},  # optional: fit max_steps to a wall-clock budget
      "eval": {"every": 100, "max_windows": 256, "batch_size": 16},
      "checkpoint": {"dir": "build/train", "every": 100, "keep": 2},
      "stop_after_minutes": null      # wall-clock guard: checkpoint and stop early (schedule unchanged)
    }

`schedule.time_budget_minutes` sizes the run to the machine: after the first
`min(20, warmup_steps)` steps (all in warmup, where the lr does not depend on the total) the
measured seconds per step fix `max_steps = min(max_steps, steps that fit in the budget)`.
The resolved value is stored in every checkpoint, so a resumed run keeps the same schedule.

Data: each JSONL file is tokenized once into a flat `uint16` token file (documents separated
by the tokenizer's eos) cached under `cache_dir` and memory-mapped. Training windows are the
non-overlapping `seq_len` slices of that stream, visited in a seeded permutation per epoch, so
the data position is a single integer (windows consumed) and resuming is exact.

Logs: `<checkpoint.dir>/log.jsonl`, one JSON object per step (`"kind": "train"`), per
evaluation (`"kind": "eval"`, with per-layer load statistics on the held-out windows) and per
resume (`"kind": "resume"`, with the config changes it accepted). A checkpoint records whether
an evaluation follows it (`eval_due`); a run stopped between the two runs that evaluation on
resume, so the held-out history has every step.

Runs never overwrite or silently continue each other: a fresh run refuses a `checkpoint.dir`
that already holds checkpoints or a log (`RunDirectoryNotEmptyError`) unless `overwrite=True`;
a resumed run refuses a config that differs from the checkpoint's in anything that changes
the result (`ResumeConfigError`, naming the keys; the input files are compared by content),
see `resume_plan`. A NaN/inf loss, gradient norm or weight stops the run before the step is
applied or saved, naming the last good checkpoint (`NonFiniteTrainingError`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moee.moe.checkpoint import (
    NonFiniteCheckpointError,
    checkpoint_dirs,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_state,
    save_checkpoint,
    sha256_file,
)
from moee.moe.layer import COLLAPSE_MAX_OVER_MEAN, balance_stats, noise_free_balance
from moee.train_settings import TRAINABLE, DataSection, TrainingConfig  # noqa: F401 (TRAINABLE re-exported)


class NonFiniteTrainingError(FloatingPointError):
    """Training produced a NaN or infinite value; the run stops without applying or saving it."""


class NonFiniteLossError(NonFiniteTrainingError):
    """The training loss became NaN or infinite; training stops at that step."""


class NonFiniteGradientError(NonFiniteTrainingError):
    """The gradient norm is NaN or infinite although the loss is finite; the update is not applied."""


class RunDirectoryNotEmptyError(FileExistsError):
    """A fresh run was pointed at a `checkpoint.dir` that holds another run's checkpoints or log."""


class ResumeConfigError(ValueError):
    """The config of a resumed run differs from its checkpoint's in a way that changes the result."""


class TrainerWarning(UserWarning):
    """Something a run accepted that its user should know about (a config change, a dropped log line)."""


# Config keys whose change on resume leaves the optimisation unchanged, with the reason.
RESUME_SAFE_KEYS: dict[str, str] = {
    "threads": "thread count; float sums may differ in the last bits",
    "stop_after_minutes": "wall-clock guard",
    "eval.every": "evaluation period",
    "eval.batch_size": "evaluation batch size",
    "checkpoint.dir": "run directory location",
    "checkpoint.every": "checkpoint period",
    "checkpoint.keep": "checkpoints kept",
    "data.cache_dir": "token cache location",
    "model.max_position_embeddings": "declared context length (>= data.seq_len); RoPE keeps no table",
}

# model keys `_build_model` fills from the tokenizer or data.seq_len when the config leaves them out
_TOKENIZER_DEFAULTS = {
    f"model.{k}"
    for k in ("vocab_size", "eos_token_id", "bos_token_id", "pad_token_id", "max_position_embeddings")
}


def load_config(source: str | os.PathLike | Mapping[str, Any] | TrainingConfig) -> dict:
    """A training config (a JSON file's path, a dict or a `TrainingConfig`) read and checked, as
    the dict every checkpoint saves (every key, defaults filled in; `TrainingConfig.to_dict`)."""
    return TrainingConfig.load(source).to_dict()


#: where the repository's own inputs come from: a missing one names the script that builds it
INPUT_PRODUCERS: dict[str, str] = {
    "build/upcycled-minilm": "scripts/train_default_model.sh (its first step, moee upcycle, builds it)",
    "build/corpus": "scripts/build_corpus.py",
}


def _looks_local(value: str) -> bool:
    """Whether a model or tokenizer source names a local path rather than a hub ``owner/name``:
    absolute or ``./``-relative, more than one ``/``, or under ``build/``."""
    return (
        os.path.isabs(value)
        or value.startswith((".", "~"))
        or value.count("/") != 1
        or value.split("/", 1)[0] == "build"
    )


def check_inputs(cfg: TrainingConfig | Mapping[str, Any]) -> None:
    """Every input path of ``cfg`` (``init.from``, ``data.train``, ``data.heldout``,
    ``data.tokenizer``) exists, checked before any work starts; one error lists all that are
    missing, each with the script that builds it (`INPUT_PRODUCERS`). A model or tokenizer source
    that reads as a hub name (``owner/name``) is left to the loader."""
    cfg = TrainingConfig.load(cfg)
    missing = []
    for key, value, always_local in (
        ("init.from", cfg.init.from_, False),
        ("data.train", cfg.data.train, True),
        ("data.heldout", cfg.data.heldout, True),
        ("data.tokenizer", cfg.data.tokenizer, False),
    ):
        if value is None or Path(value).expanduser().exists():
            continue
        if not always_local and not _looks_local(str(value)):
            continue
        norm = Path(value).as_posix()
        producer = next((s for prefix, s in INPUT_PRODUCERS.items() if norm.startswith(prefix)), None)
        hint = f" (built by {producer})" if producer else ""
        missing.append(f"{key} {value}{hint}")
    if missing:
        raise FileNotFoundError(
            f"missing input(s), relative to {os.getcwd()}: " + "; ".join(missing) + "; build them first"
        )


def lr_at(step: int, max_steps: int, warmup_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the base lr at 0-based `step`: linear warmup, then cosine decay to min_lr_ratio."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


# ----------------------------------------------------------------------------- data


def iter_jsonl_texts(path: str | os.PathLike):
    """Yield the "text" of every line of a JSONL file; a bad line raises ValueError with its number."""
    from moee.io import iter_jsonl

    for lineno, record in iter_jsonl(path):
        text = record.get("text")
        if not isinstance(text, str):
            raise ValueError(f'{path}:{lineno}: expected an object with a string "text" field')
        yield text


def tokenize_to_file(jsonl: str | os.PathLike, tokenizer: Any, cache_dir: str | os.PathLike) -> Path:
    """Tokenize a JSONL corpus once into a flat uint16 file (docs separated by eos); return its path.

    The cache name includes the SHA-256 of the corpus and of the tokenizer, so a changed input
    never reuses a stale token file.
    """
    jsonl = Path(jsonl)
    if not jsonl.exists():
        raise FileNotFoundError(f"corpus file {jsonl} not found")
    if len(tokenizer) > np.iinfo(np.uint16).max + 1:
        raise ValueError(f"vocabulary of {len(tokenizer)} tokens does not fit in uint16")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos token (needed to separate documents)")
    # a tokenizer with its own BOS (distinct from EOS) starts every document with it, as at inference
    bos = tokenizer.bos_token_id
    head = (bos,) if bos is not None and bos != eos else ()
    tok_digest = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()
    key = hashlib.sha256((sha256_file(jsonl) + tok_digest).encode()).hexdigest()[:16]
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    out = cache / f"{jsonl.stem}-{key}.u16"
    meta_path = out.with_suffix(".json")
    if out.exists() and meta_path.exists():
        return out
    # a temporary of this writer's own: runs that share the cache tokenize side by side (each
    # renames identical bytes into place) instead of writing into one file and one losing its rename
    from moee.io import temporary_path, write_json_atomic

    tmp = temporary_path(out, "tmp")
    n_tokens = n_docs = 0
    try:
        with open(tmp, "xb") as f:
            batch: list[str] = []

            def flush() -> None:
                nonlocal n_tokens, n_docs
                ids = tokenizer(batch, add_special_tokens=False)["input_ids"]
                flat = np.fromiter((t for doc in ids for t in (*head, *doc, eos)), dtype=np.uint16)
                f.write(flat.tobytes())
                n_tokens += flat.size
                n_docs += len(batch)
                batch.clear()

            for text in iter_jsonl_texts(jsonl):
                batch.append(text)
                if len(batch) >= 1000:
                    flush()
            if batch:
                flush()
    except BaseException:
        tmp.unlink(missing_ok=True)  # a failed or interrupted run leaves no temporary behind
        raise
    os.replace(tmp, out)
    meta = {"source": str(jsonl), "n_tokens": n_tokens, "n_docs": n_docs, "eos": eos, "vocab": len(tokenizer)}
    write_json_atomic(meta_path, meta)  # last: a cache entry with its .json is complete
    return out


def load_tokens(path: str | os.PathLike) -> np.ndarray:
    return np.memmap(path, dtype=np.uint16, mode="r")


class _SeededOrder:
    """Item ``pos`` of a seeded stream over ``n`` items: epoch e visits them in the permutation
    drawn from ``numpy.random.default_rng([seed, e])``, so a position is all a resume needs."""

    def __init__(self, n: int, seed: int):
        self._n = n
        self.seed = seed
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    def _index(self, pos: int) -> int:
        epoch, offset = divmod(pos, self._n)
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self._n)
            self._perm_epoch = epoch
        return int(self._perm[offset])


class WindowSampler(_SeededOrder):
    """Deterministic batches of contiguous `seq_len` windows from a flat token stream.

    Window i covers tokens [i*seq_len, (i+1)*seq_len). Epoch e visits the windows in the
    permutation drawn from `numpy.random.default_rng([seed, e])`; `position` counts windows
    consumed so far, which is all a checkpoint needs to resume the data stream exactly.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int):
        self.tokens = tokens
        self.seq_len = seq_len
        self.n_windows = len(tokens) // seq_len
        if self.n_windows < 1:
            raise ValueError(f"the corpus has {len(tokens)} tokens, fewer than one window of {seq_len}")
        super().__init__(self.n_windows, seed)

    def batch(self, position: int, batch_size: int) -> torch.Tensor:
        rows = []
        for pos in range(position, position + batch_size):
            w = self._index(pos)
            rows.append(np.asarray(self.tokens[w * self.seq_len : (w + 1) * self.seq_len], dtype=np.int64))
        return torch.from_numpy(np.stack(rows))


def eval_windows(tokens: np.ndarray, seq_len: int, max_windows: int | None) -> torch.Tensor:
    """The first `max_windows` non-overlapping windows of the held-out stream (fixed, in order)."""
    n = len(tokens) // seq_len
    if max_windows:
        n = min(n, max_windows)
    if n < 1:
        raise ValueError(f"the held-out corpus has {len(tokens)} tokens, fewer than one window of {seq_len}")
    return torch.from_numpy(np.asarray(tokens[: n * seq_len], dtype=np.int64).reshape(n, seq_len))


def unigram_cross_entropy(train_tokens: np.ndarray, eval_tokens: torch.Tensor, vocab_size: int) -> float:
    """Cross-entropy (nats/token) of an add-one unigram model of the training tokens on the
    positions the LM predicts (every window position after the first)."""
    counts = np.bincount(np.asarray(train_tokens), minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    targets = eval_tokens[:, 1:].reshape(-1).numpy()
    return float(-logp[targets].mean())


# ----------------------------------------------------------------------------- evaluation


class _LoadTally:
    """Per-MoE-layer top-k selection counts (the noise-free decision,
    `moee.moe.layer.noise_free_balance`) and router importance, summed over forwards."""

    def __init__(self) -> None:
        self.loads: list[torch.Tensor] = []
        self.importance: list[torch.Tensor] = []

    def add(self, moe_aux: list[dict]) -> None:
        step = [(noise_free_balance(a)[0], a["importance"]) for a in moe_aux]
        if not self.loads:
            self.loads = [load.clone() for load, _ in step]
            self.importance = [imp.clone() for _, imp in step]
            return
        for i, (load, imp) in enumerate(step):
            self.loads[i] += load
            self.importance[i] += imp

    def layers(self) -> list[dict]:
        """CV with the population std; max/mean = the heaviest expert's load over the mean load
        (ceiling: experts / top-k); ``dead`` = experts no token selected."""
        layers = []
        for load, imp in zip(self.loads, self.importance):
            stats = balance_stats(imp.float(), load.float())
            layers.append(
                {
                    "cv_load": float(stats["cv_load"]),
                    "max_over_mean_load": float(stats["max_over_mean_load"]),
                    "cv_importance": float(stats["cv_importance"]),
                    "dead": int((load == 0).sum()),
                    "load": load.tolist(),
                }
            )
        return layers


@torch.no_grad()
def evaluate(model: torch.nn.Module, windows: torch.Tensor, batch_size: int) -> dict:
    """Held-out LM loss/perplexity and per-layer load statistics in eval mode (no gate noise).

    Load is the count of top-k selections per expert over all held-out tokens (the noise-free
    decision, `moee.moe.layer.noise_free_balance`, the statistic training logs per batch too);
    see `_LoadTally.layers` for the figures.
    """
    was_training = model.training
    model.eval()
    total_nll = 0.0
    total_tokens = 0
    tally = _LoadTally()
    for start in range(0, len(windows), batch_size):
        batch = windows[start : start + batch_size]
        out = model(input_ids=batch, labels=batch)
        n = batch.shape[0] * (batch.shape[1] - 1)
        total_nll += out.lm_loss.item() * n
        total_tokens += n
        tally.add(out.moe_aux)
    model.train(was_training)
    loss = total_nll / total_tokens
    return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": total_tokens, "layers": tally.layers()}


class DocumentSampler(_SeededOrder):
    """Deterministic batches of whole documents, each tokenized as a user's text is (special
    tokens, truncated to the context): the input the embedder and the report route, which the
    training windows (cut anywhere in a document stream) do not cover, e.g. position 0 always
    holding the first token of a document."""

    def __init__(self, documents: list[list[int]], seed: int):
        if not documents or not all(documents):
            raise ValueError("DocumentSampler needs at least one document, and no empty one")
        self.documents = documents
        super().__init__(len(documents), seed)

    @classmethod
    def from_jsonl(
        cls, jsonl: str | os.PathLike, tokenizer: Any, max_length: int, seed: int, limit: int | None = None
    ) -> DocumentSampler:
        """The first ``limit`` non-empty texts of a JSONL corpus (field ``text``), tokenized."""
        from moee.io import iter_jsonl

        texts = []
        for _, row in iter_jsonl(jsonl):
            if str(row.get("text") or "").strip():
                texts.append(row["text"])
                if limit is not None and len(texts) >= limit:
                    break
        ids = tokenizer(texts, add_special_tokens=True, truncation=True, max_length=max_length)["input_ids"]
        return cls([list(map(int, x)) for x in ids], seed)

    def batch(self, position: int, batch_size: int) -> list[torch.Tensor]:
        """Documents ``position .. position + batch_size - 1`` of the seeded order (each [1, length])."""
        return [
            torch.tensor([self.documents[self._index(pos)]], dtype=torch.long)
            for pos in range(position, position + batch_size)
        ]


@torch.no_grad()
def document_load(model: torch.nn.Module, documents: list[list[int]], first: int = 0) -> dict:
    """Per-layer load statistics over whole documents, each forwarded alone (no padding counted),
    in eval mode: the figure ``moee report`` gives on the same texts (figures as `evaluate`'s,
    plus the worst layer's max/mean). With ``first``, the figures of the first ``first``
    documents alone too (``"first"``), from the same forwards."""
    was_training = model.training
    model.eval()
    tally = _LoadTally()
    result: dict = {"n": len(documents)}
    try:
        for i, doc in enumerate(documents):
            tally.add(model(input_ids=torch.tensor([doc], dtype=torch.long)).moe_aux)
            if i + 1 == first:
                result["first"] = {"n": first, "layers": tally.layers()}
    finally:
        model.train(was_training)
    result["layers"] = tally.layers()
    result["max_over_mean_load_worst"] = max(
        (x["max_over_mean_load"] for x in result["layers"]), default=None
    )
    return result


@torch.no_grad()
def calibrate_router_biases(
    model: torch.nn.Module,
    sampler: WindowSampler,
    position: int,
    batch_size: int,
    steps: int,
    gamma: float,
    documents: DocumentSampler | None = None,
    documents_per_step: int = 0,
) -> int:
    """Settle the selection biases of loss-free gates with all weights frozen.

    Runs `steps` calibration steps with the model in eval mode (no dropout, so the result is
    deterministic and matches inference) and only the gates in train mode: each forwards `batch_size` training windows
    (from data `position`) and, with `documents`, `documents_per_step` whole documents one at a
    time (so no padding is counted); the loads of the step accumulate and each
    `LossFreeBalancedGate` then applies its own update rule once, with the bias step decaying
    linearly from `gamma` to 0. A constant step leaves the final bias anywhere within about one
    step of the balance point; the decay lets it settle. Windows alone balance the positions a
    window reaches; documents add what a user's text looks like (a document start at position
    0, short texts). Returns the new window position.
    """
    from moee.moe.gates import LossFreeBalancedGate

    gates = [m for m in model.modules() if isinstance(m, LossFreeBalancedGate)]
    if not gates or steps <= 0:
        return position
    if not gamma > 0:
        raise ValueError(f"calibration gamma must be > 0, got {gamma}")
    if documents_per_step and documents is None:
        raise ValueError("documents_per_step needs a DocumentSampler (documents=...)")
    was_training = model.training
    saved = [(g.gamma, g.auto_update) for g in gates]
    model.eval()  # no dropout: the biases settle on the activations inference sees, and no draw
    try:
        for g in gates:
            g.train()  # only the gates count their loads
            g.auto_update = False
            g.pending_load.zero_()
        for t in range(steps):
            if batch_size:
                model(input_ids=sampler.batch(position, batch_size))
                position += batch_size
            if documents_per_step:
                for doc in documents.batch(t * documents_per_step, documents_per_step):
                    model(input_ids=doc)
            for g in gates:
                g.gamma = gamma * (1.0 - t / steps)
                g.update_bias()
    finally:
        for g, (gm, auto) in zip(gates, saved):
            g.gamma, g.auto_update = gm, auto
            g.pending_load.zero_()
        model.train(was_training)
    return position


# ----------------------------------------------------------------------------- training


@dataclass
class TrainResult:
    step: int
    checkpoint: Path | None
    last_eval: dict | None
    stopped_early: bool


def _build_model(cfg: TrainingConfig, tokenizer: Any):
    from moee.moe.lm import MoEEConfig, MoEEForCausalLM

    if cfg.init.from_ is not None:
        return _load_init(cfg.init.from_, tokenizer, cfg.data.seq_len)

    kwargs = dict(cfg.model)
    kwargs.setdefault("vocab_size", len(tokenizer))
    kwargs.setdefault("eos_token_id", tokenizer.eos_token_id)
    kwargs.setdefault("bos_token_id", tokenizer.bos_token_id)
    kwargs.setdefault("pad_token_id", tokenizer.pad_token_id)
    kwargs.setdefault("max_position_embeddings", cfg.data.seq_len)
    if kwargs["vocab_size"] < len(tokenizer):
        raise ValueError(f"model.vocab_size {kwargs['vocab_size']} < tokenizer size {len(tokenizer)}")
    torch.manual_seed(cfg.seed)
    return MoEEForCausalLM(MoEEConfig(**kwargs))


def _load_init(source: str, tokenizer: Any, seq_len: int):
    """Continued pretraining: the model saved at ``source`` (safetensors; e.g. a `moee upcycle`
    output), checked against the tokenizer and the window length."""
    from moee.loading import LoadOptions, load_model

    # the loader of every command (any moee model type, a training checkpoint, name@revision), in
    # float32 on the CPU; the trainer moves it to its device
    model = load_model(source, LoadOptions(dtype="float32", device="cpu"), tokenizer=False).model
    vocab = model.get_input_embeddings().weight.shape[0]
    if vocab < len(tokenizer):
        raise ValueError(f"init.from {source}: its vocabulary of {vocab} < tokenizer size {len(tokenizer)}")
    text = getattr(model.config, "text_config", model.config)
    max_pos = getattr(text, "max_position_embeddings", None)
    if max_pos is not None and max_pos < seq_len:
        raise ValueError(f"init.from {source}: max_position_embeddings {max_pos} < data.seq_len {seq_len}")
    return model


def _append_log(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_log(path: str | os.PathLike) -> list[dict]:
    """The records of a `log.jsonl`; every error names the file and line.

    A last line without its newline that does not parse is what a crash mid-write leaves: it
    is dropped with a `TrainerWarning`. Any other bad line is a `ValueError`.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"training log {path} is corrupt (not UTF-8): {exc}") from exc
    lines = text.split("\n")
    tail = lines.pop()  # "" when the file ends with a newline
    records = []
    for lineno, line in enumerate([*lines, tail], 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if lineno == len(lines) + 1:
                warnings.warn(
                    f"{path}:{lineno}: dropping a partial last line ({len(line)} characters; "
                    "the run stopped mid-write)",
                    TrainerWarning,
                    stacklevel=2,
                )
                continue
            raise ValueError(f"{path}:{lineno}: invalid JSON in the training log: {exc}") from exc
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError(f"{path}:{lineno}: expected a log record with an integer 'step'")
        records.append(record)
    return records


def _truncate_log(path: Path, step: int) -> list[dict]:
    """Drop log records after `step` (written by a run that died after its last checkpoint).

    The log is rewritten to a temporary file and renamed, so a crash here loses nothing.
    Returns the records kept.
    """
    if not path.exists():
        return []
    kept = [r for r in read_log(path) if r["step"] <= step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(tmp, path)
    return kept


def load_ceiling(model: torch.nn.Module) -> float:
    """The largest max/mean load a layer can show: experts / top-k (every token on the same experts)."""
    cfg = model.config
    return cfg.num_experts / cfg.num_experts_per_tok


def collapse_warning(
    where: str, layers: list[dict], ceiling: float, router_type: str | None = None
) -> str | None:
    """The warning for the layers (``max_over_mean_load``, ``dead``) that look collapsed:
    max/mean above `moee.moe.layer.COLLAPSE_MAX_OVER_MEAN` or an expert no token selected, with
    the remedy that applies to the model's ``router_type``."""
    bad = [
        f"layer {i}: max/mean {layer['max_over_mean_load']:.2f}, {layer['dead']} dead"
        for i, layer in enumerate(layers)
        if layer["max_over_mean_load"] > COLLAPSE_MAX_OVER_MEAN or layer["dead"]
    ]
    if not bad:
        return None
    if router_type == "loss_free":
        remedy = (
            "the loss-free bias moves towards balance by router_bias_gamma per step (a freshly upcycled "
            "model can collapse around the warm-up and recover, docs/UPCYCLING.md); if it persists, "
            "raise router_bias_gamma"
        )
    else:
        remedy = (
            "raise the gate's balancing-loss weights (its router_w_* fields, moee/moe/README_TRAINING.md; "
            "a load loss needs router_noisy), lower optim.router_lr_scale, or use router_type loss_free "
            "(an init.from model takes its router from `moee upcycle --router`)"
        )
    return (
        f"{where}: routing collapse in {len(bad)} of {len(layers)} layers ({'; '.join(bad)}; ceiling "
        f"{ceiling:.2f} = experts / top-k): {remedy}"
    )


def _log_eval(
    log_path: Path, step: int, result: dict, bar: Any, ceiling: float, router_type: str | None = None
) -> dict:
    """Append the held-out evaluation of ``step`` to the log and show it (on ``bar``, else stderr),
    with the max/mean ceiling and a `TrainerWarning` when a layer collapsed."""
    _append_log(log_path, {"kind": "eval", "step": step, **result})
    worst = max((layer["max_over_mean_load"] for layer in result["layers"]), default=0.0)
    dead = sum(layer.get("dead", 0) for layer in result["layers"])
    line = (
        f"step {step}: held-out loss {result['loss']:.4f} ppl {result['ppl']:.2f} "
        f"max/mean {worst:.2f} of ceiling {ceiling:.2f}, dead experts {dead}"
    )
    if bar is not None:
        bar.write(line)
    else:
        print(line, file=sys.stderr)
    message = collapse_warning(f"held-out evaluation at step {step}", result["layers"], ceiling, router_type)
    if message:
        warnings.warn(message, TrainerWarning, stacklevel=2)
    return result


def _flatten(cfg: dict) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in cfg.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{sub}": v for sub, v in value.items()})
        else:
            flat[key] = value
    return flat


def input_digests(data: DataSection, tokenizer: Any, train_token_file: Path) -> dict[str, str | None]:
    """Content hashes of a run's inputs, stored in each checkpoint so resume compares content, not paths.

    `tokenization` covers what the tokenizer contributes: the training token stream it produced
    and its vocabulary size and special ids.
    """
    specials = [len(tokenizer), tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id]
    return {
        "train": sha256_file(data.train),
        "heldout": sha256_file(data.heldout) if data.heldout else None,
        "tokenization": hashlib.sha256(
            json.dumps([sha256_file(train_token_file), *specials]).encode()
        ).hexdigest(),
    }


def _content_check(key: str, old: dict, new: dict) -> bool | None:
    """Whether input `key` kept its content; None when that cannot be told apart from data.train."""
    if key == "data.train":
        return old.get("train") == new["train"]
    if key == "data.heldout":
        return old.get("heldout") == new["heldout"]
    if old.get("train") != new["train"]:
        return None  # the token stream changed with the corpus; data.train already says so
    return old.get("tokenization") == new["tokenization"]


def resume_plan(
    state: dict, cfg: TrainingConfig | Mapping[str, Any], inputs: dict, where: Path
) -> tuple[int, list[str]]:
    """Compare a resumed run's config with its checkpoint's; return (max_steps, accepted changes).

    Resuming is exact only when everything that shapes the computation is unchanged, so any
    other difference raises `ResumeConfigError` naming every such key. Accepted: the keys in
    `RESUME_SAFE_KEYS`; input files moved to another path with the same content (they are
    compared by SHA-256, and a changed file is refused even under the same path); a raised
    `schedule.max_steps`, which extends the run (the cosine schedule after the resumed step
    follows the new total); and a changed `time_budget_minutes` once the budget was resolved.
    """
    from moee.moe.lm import MoEEConfig

    cfg = TrainingConfig.load(cfg)
    # the checkpoint's config as it was saved (keys an older trainer did not write take the defaults)
    old, new = _flatten(state.get("config") or {}), _flatten(cfg.to_dict())
    defaults = _flatten(TrainingConfig.default_dict())
    # a model key left out means MoEEConfig's default (or the tokenizer's / seq_len, see _build_model)
    defaults.update(
        {
            k: getattr(MoEEConfig, k.split(".", 1)[1], "<unset>")
            for k in set(old) | set(new)
            if k.startswith("model.") and k not in _TOKENIZER_DEFAULTS
        }
    )
    old_inputs = state.get("inputs")
    step = state["step"]
    refused: list[str] = []
    accepted: list[str] = []
    for key in sorted(set(old) | set(new)):
        if key in ("schedule.max_steps", "schedule.time_budget_minutes"):
            continue
        a, b = old.get(key, defaults.get(key, "<unset>")), new.get(key, defaults.get(key, "<unset>"))
        if key in ("data.train", "data.heldout", "data.tokenizer") and old_inputs is not None:
            same = _content_check(key, old_inputs, inputs)
            if same is False:
                refused.append(f"{key} (content changed: {a!r} -> {b!r})")
            elif same and a != b:
                accepted.append(f"{key}: {a!r} -> {b!r} (same content)")
        elif a != b:
            if key in RESUME_SAFE_KEYS:
                accepted.append(f"{key}: {a!r} -> {b!r} ({RESUME_SAFE_KEYS[key]})")
            else:
                refused.append(f"{key} ({a!r} -> {b!r})")
    if old_inputs is None:
        accepted.append("the checkpoint predates input hashing: data files compared by path only")

    stored_cfg_total = old.get("schedule.max_steps", new["schedule.max_steps"])
    stored_total = state.get("max_steps", stored_cfg_total)
    total = stored_total if new["schedule.max_steps"] == stored_cfg_total else new["schedule.max_steps"]
    if total > stored_total:
        accepted.append(
            f"schedule.max_steps: {stored_total} -> {total} (the run continues to step {total}; the lr "
            f"schedule after step {step} follows the new total)"
        )
    elif total < stored_total:
        refused.append(
            f"schedule.max_steps ({stored_total} -> {total}; to stop earlier, keep it and use --stop-at-step)"
        )
    budget_old = old.get("schedule.time_budget_minutes")
    budget_new = new["schedule.time_budget_minutes"]
    if budget_old != budget_new:
        resolved = bool(budget_old) and "max_steps" in state and step >= _calibration_step(cfg)
        if resolved:
            accepted.append(
                f"schedule.time_budget_minutes: {budget_old!r} -> {budget_new!r} (no effect: the budget "
                f"was resolved to max_steps = {stored_total})"
            )
        else:
            refused.append(f"schedule.time_budget_minutes ({budget_old!r} -> {budget_new!r})")
    if refused:
        raise ResumeConfigError(
            f"--resume from {where}: the config differs from the checkpoint's in what changes the result: "
            f"{'; '.join(refused)}. Restore these values, or start a new run in another checkpoint.dir "
            "(or replace this one with --overwrite)"
        )
    return total, accepted


def _calibration_step(cfg: TrainingConfig) -> int:
    """The step after which `time_budget_minutes` fixes max_steps (all in warmup)."""
    return max(1, min(20, cfg.schedule.warmup_steps))


def _calibrate_at(cfg: TrainingConfig, resumed_step: int | None) -> int | None:
    """The step at which `time_budget_minutes` fixes max_steps: None without a budget, or when the
    resumed run had already resolved it."""
    if not cfg.schedule.time_budget_minutes:
        return None
    at = _calibration_step(cfg)
    return None if resumed_step is not None and resumed_step >= at else at


def _run_artifacts(out_dir: Path) -> list[Path]:
    """What a training run leaves in its directory: checkpoints (complete or not) and the log."""
    log = out_dir / "log.jsonl"
    return checkpoint_dirs(out_dir) + ([log] if log.exists() else [])


def _last_good(out_dir: Path) -> str:
    ckpt = latest_checkpoint(out_dir)
    return f"last good checkpoint: {ckpt}" if ckpt else "no checkpoint was saved yet"


def _open_run(
    cfg: TrainingConfig, resume: bool, overwrite: bool
) -> tuple[Path | None, dict | None, list[Path]]:
    """Check ``checkpoint.dir`` before any data is read: on resume the newest checkpoint and its
    state, on a fresh run the previous run's files an overwrite replaces (refused without it)."""
    if resume and overwrite:
        raise ValueError(
            "resume and overwrite exclude each other: resume continues the run, overwrite replaces it"
        )
    out_dir = Path(cfg.checkpoint.dir)
    if not resume:  # a fresh run (--overwrite above all) must never delete or shadow its inputs
        from moee.io import check_not_an_input

        data = cfg.data
        sources = ("init.from", "data.train", "data.heldout", "data.tokenizer")
        values = (cfg.init.from_, data.train, data.heldout, data.tokenizer)
        check_not_an_input(out_dir, dict(zip(sources, values)), what="checkpoint.dir")
    if resume:
        ckpt = latest_checkpoint(out_dir)
        if ckpt is None:
            raise FileNotFoundError(f"--resume: no checkpoint found in {out_dir}")
        try:
            state = read_state(ckpt)
        except ValueError as exc:
            older = [c.name for c in list_checkpoints(out_dir)[:-1]]
            if not older:
                raise
            raise ValueError(
                f"{exc}; earlier checkpoints in {out_dir}: {', '.join(older)} (move {ckpt.name} away to "
                f"resume from {older[-1]})"
            ) from exc
        return ckpt, state, []
    existing = _run_artifacts(out_dir)
    if existing and not overwrite:
        raise RunDirectoryNotEmptyError(
            f"{out_dir} already holds a training run ({', '.join(p.name for p in existing[-3:])}); "
            "continue it with --resume, train into another checkpoint.dir, or replace it with "
            "--overwrite (deletes its checkpoints and log.jsonl)"
        )
    return None, None, existing


def _heldout_windows(cfg: TrainingConfig, tokenizer: Any) -> torch.Tensor | None:
    """The held-out evaluation windows, or None when the config names no held-out file."""
    data = cfg.data
    if not data.heldout:
        return None
    return eval_windows(
        load_tokens(tokenize_to_file(data.heldout, tokenizer, data.cache_dir)),
        data.seq_len,
        cfg.eval.max_windows,
    )


def _make_optimizer(model: torch.nn.Module, optim_cfg: Any) -> torch.optim.AdamW:
    """AdamW over groups (router or not, decayed or not), freezing what ``optim.trainable`` leaves out.

    Each group carries its ``lr_scale``: the router's is ``optim.router_lr_scale``.
    """
    # Adam moves every router weight by ~lr per step whatever its gradient scale, which can make
    # all tokens pick the same experts faster than balancing reacts; router_lr_scale slows it.
    groups: dict[tuple[bool, bool], list] = {}
    # every gate inside a MoEERouter carries _moee_router_part (moee_lm and upcycled models alike)
    router_params = {
        id(p) for m in model.modules() if getattr(m, "_moee_router_part", False) for p in m.parameters()
    }
    if optim_cfg.trainable == "routed":
        from moee.moe.delta import routed_parameter_ids

        keep = routed_parameter_ids(model)
        for p in model.parameters():
            p.requires_grad_(id(p) in keep)
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_router = id(p) in router_params
        decays = p.dim() >= 2 and not is_router
        groups.setdefault((is_router, decays), []).append(p)
    param_groups = [
        {
            "params": params,
            "weight_decay": optim_cfg.weight_decay if decays else 0.0,
            "lr_scale": optim_cfg.router_lr_scale if is_router else 1.0,
        }
        for (is_router, decays), params in sorted(groups.items())
    ]
    return torch.optim.AdamW(
        param_groups,
        lr=optim_cfg.lr,
        betas=optim_cfg.betas,
        eps=optim_cfg.eps,
    )


def _clear_previous_run(existing: list[Path], out_dir: Path) -> None:
    """Delete the previous run's checkpoints and log (only with overwrite=True, checked by `_open_run`)."""
    for old in existing:
        if old.is_dir():
            shutil.rmtree(old)
        else:
            old.unlink()
    out_dir.mkdir(parents=True, exist_ok=True)


def _train_record(
    step: int, lr: float, out: Any, grad_norm: torch.Tensor, tokens_per_s: float, position: int
) -> dict:
    """The log record of one training step, with the noise-free decision's load (the statistic
    evaluation reports, per batch here)."""
    balance = [noise_free_balance(a) for a in out.moe_aux]
    cv = [b[1] for b in balance]
    mm = [b[2] for b in balance]
    dead = [int((b[0] == 0).sum()) for b in balance]
    lm = out.lm_loss.item()
    return {
        "kind": "train",
        "step": step,
        "lr": lr,
        "loss": out.loss.item(),
        "lm_loss": lm,
        "aux_loss": out.aux_loss.item(),
        "ppl": math.exp(min(lm, 50.0)),
        "grad_norm": float(grad_norm),
        "cv_load_mean": sum(cv) / max(1, len(cv)),
        "max_over_mean_load_max": max(mm, default=0.0),
        "dead_experts": sum(dead),
        "tokens_per_s": tokens_per_s,
        "data_position": position,
    }


@dataclass
class _Run:
    """What a training run holds fixed while it steps: config, model, optimizer, data, outputs."""

    cfg: TrainingConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    sampler: WindowSampler
    heldout: torch.Tensor | None
    inputs: dict

    def __post_init__(self) -> None:
        self.out_dir = Path(self.cfg.checkpoint.dir)
        self.log_path = self.out_dir / "log.jsonl"
        self.ceiling = load_ceiling(self.model)
        self.router_type = getattr(self.model.config, "router_type", None)
        self.saved_config = self.cfg.to_dict()  # what every checkpoint records (resume_plan compares with it)

    def resume_from(self, ckpt: Path, state: dict, accepted: list[str]) -> tuple[dict, list[dict]]:
        """Load the checkpoint into the model and optimizer, cut the log back to its step and log
        the resume; return the checkpoint's state and the log records kept."""
        state = load_checkpoint(ckpt, self.model, self.optimizer, state)
        step = state["step"]
        previous = _truncate_log(self.log_path, step)
        _append_log(
            self.log_path, {"kind": "resume", "step": step, "checkpoint": ckpt.name, "accepted": accepted}
        )
        if accepted:
            warnings.warn(
                f"--resume from {ckpt}: accepted config change(s): {'; '.join(accepted)}",
                TrainerWarning,
                stacklevel=3,  # train()'s caller, as when this was inline
            )
        return state, previous

    def resumed_eval(self, previous: list[dict], step: int, state: dict) -> dict | None:
        """The held-out evaluation of the resumed step: the logged one, or run now when the
        interrupted run stopped between the checkpoint and the evaluation that follows it."""
        evals = [r for r in previous if r.get("kind") == "eval" and r["step"] == step]
        if evals:
            return {k: v for k, v in evals[-1].items() if k not in ("kind", "step")}
        if self.heldout is not None and state.get("eval_due", step % self.cfg.eval.every == 0):
            # the run stopped between this checkpoint and the evaluation that follows it: run
            # that evaluation now, so the held-out history keeps every step
            return self.evaluate(step, None)
        return None

    def evaluate(self, step: int, bar: Any) -> dict:
        """Evaluate on the held-out windows and log it (`_log_eval`)."""
        result = evaluate(self.model, self.heldout, self.cfg.eval.batch_size)
        return _log_eval(self.log_path, step, result, bar, self.ceiling, self.router_type)

    def step(self, step: int, position: int, mult: float) -> tuple[Any, torch.Tensor]:
        """One optimizer step on the batch at ``position``; a NaN/inf loss, gradient norm or weight
        stops the run before the step is applied or saved. Returns the output and gradient norm."""
        optim_cfg = self.cfg.optim
        for group in self.optimizer.param_groups:
            group["lr"] = optim_cfg.lr * mult * group["lr_scale"]
        batch = self.sampler.batch(position, optim_cfg.batch_size)
        out = self.model(input_ids=batch, labels=batch)
        loss = out.loss
        if not torch.isfinite(loss):
            raise NonFiniteLossError(
                f"non-finite training loss ({loss.item()}) at step {step + 1}; stopping ({_last_good(self.out_dir)})"
            )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), optim_cfg.grad_clip)
        if not torch.isfinite(grad_norm):
            raise NonFiniteGradientError(
                f"non-finite gradient norm ({float(grad_norm)}) at step {step + 1} with a finite loss "
                f"({loss.item():.6g}); the update was not applied ({_last_good(self.out_dir)})"
            )
        self.optimizer.step()
        bad = next((n for n, p in self.model.named_parameters() if not bool(torch.isfinite(p).all())), None)
        if bad is not None:
            raise NonFiniteTrainingError(
                f"the update at step {step + 1} made {bad} NaN or infinite (finite loss and gradient; lr too "
                f"high?); it is not saved ({_last_good(self.out_dir)})"
            )
        return out, grad_norm

    def save(self, step: int, position: int, max_steps: int, eval_due: bool) -> Path:
        """Checkpoint ``step``; a non-finite weight names the last good checkpoint."""
        try:
            return save_checkpoint(
                self.out_dir,
                step=step,
                model=self.model,
                optimizer=self.optimizer,
                data_position=position,
                config=self.saved_config,
                # whether a held-out evaluation follows this checkpoint: a resume from it runs
                # that evaluation when the log does not hold it (a stop between the two)
                extra={"max_steps": max_steps, "inputs": self.inputs, "eval_due": eval_due},
                keep=self.cfg.checkpoint.keep,
            )
        except NonFiniteCheckpointError as exc:
            raise NonFiniteTrainingError(f"at step {step}: {exc} ({_last_good(self.out_dir)})") from exc

    def fit_budget(self, step: int, steps_run: int, t_start: float, max_steps: int, bar: Any) -> int:
        """``max_steps`` fitted to ``schedule.time_budget_minutes`` from the seconds per step so far."""
        budget = self.cfg.schedule.time_budget_minutes
        per_step = (time.time() - t_start) / max(1, steps_run)
        fit = step + int((60 * budget - (time.time() - t_start)) * 0.92 / per_step)
        max_steps = max(step + 1, min(max_steps, fit))
        bar.total = max_steps
        bar.write(f"time budget {budget} min at {per_step:.2f} s/step: max_steps = {max_steps}")
        _append_log(
            self.log_path, {"kind": "schedule", "step": step, "max_steps": max_steps, "s_per_step": per_step}
        )
        return max_steps


def _prepare_run(
    cfg: TrainingConfig, resume: bool, ckpt: Path | None, state: dict | None
) -> tuple[_Run, int, list[str]]:
    """Tokenize the data, check a resumed config against its checkpoint (before the model is
    built), then build the model and optimizer; return the run, max_steps and accepted changes."""
    from transformers import AutoTokenizer

    data = cfg.data
    tokenizer = AutoTokenizer.from_pretrained(data.tokenizer)
    train_file = tokenize_to_file(data.train, tokenizer, data.cache_dir)
    train_tokens = load_tokens(train_file)
    inputs = input_digests(data, tokenizer, train_file)
    max_steps = cfg.schedule.max_steps
    accepted: list[str] = []
    if resume:
        max_steps, accepted = resume_plan(state, cfg, inputs, ckpt)
    sampler = WindowSampler(train_tokens, data.seq_len, cfg.seed)
    heldout = _heldout_windows(cfg, tokenizer)

    model = _build_model(cfg, tokenizer)
    model.train()
    return _Run(cfg, model, _make_optimizer(model, cfg.optim), sampler, heldout, inputs), max_steps, accepted


def _show_step(bar: Any, record: dict, ceiling: float) -> None:
    """Advance the progress bar with the step's loss and load figures."""
    bar.update(1)
    bar.set_postfix(
        loss=f"{record['lm_loss']:.3f}",
        ppl=f"{record['ppl']:.1f}",
        cv_load=f"{record['cv_load_mean']:.2f}",
        max_mean=f"{record['max_over_mean_load_max']:.2f}/{ceiling:.2f}",
        dead=record["dead_experts"],
        tok_s=f"{record['tokens_per_s']:.0f}",
    )


def train(
    config: str | os.PathLike | Mapping[str, Any] | TrainingConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    stop_at_step: int | None = None,
    progress: bool = True,
) -> TrainResult:
    """Run (or resume) training as described by `config`; return the final step and checkpoint.

    A fresh run needs a `checkpoint.dir` without another run's checkpoints or log, or
    `overwrite=True`, which deletes them (once the data and model are set up; nothing else there),
    and one that is not an input (``init.from``, ``data.*``), holds none and lies inside none:
    ``init.from: RUN/step_N`` with ``checkpoint.dir: RUN`` would delete the start. `resume=True`
    continues the newest checkpoint after `resume_plan` accepted the config.
    `stop_at_step` ends the run after that step with a checkpoint, as if interrupted (used to
    test exact resume); the schedule still follows `schedule.max_steps`.
    """
    from tqdm.auto import tqdm

    cfg = TrainingConfig.load(config)  # read and checked once
    check_inputs(cfg)
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    sched = cfg.schedule
    ckpt, state, existing = _open_run(cfg, resume, overwrite)
    run, max_steps, accepted = _prepare_run(cfg, resume, ckpt, state)
    heldout = run.heldout

    if resume:
        state, previous = run.resume_from(ckpt, state, accepted)
        step, position = state["step"], state["data_position"]
    else:
        step = position = 0
        _clear_previous_run(existing, run.out_dir)
        torch.manual_seed(cfg.seed + 1)  # training-time randomness (gate noise) after the init draw
    calibrate_at = _calibrate_at(cfg, step if resume else None)

    last_stop = max_steps if stop_at_step is None else min(max_steps, stop_at_step)
    start_step = step
    bs, seq_len = cfg.optim.batch_size, cfg.data.seq_len
    deadline = time.time() + 60 * cfg.stop_after_minutes if cfg.stop_after_minutes else None
    last_eval = None
    ckpt_path = None
    if resume:  # what the checkpoint reached, in case there is nothing left to train
        ckpt_path = ckpt
        last_eval = run.resumed_eval(previous, step, state)
    t_start = time.time()
    tokens_run = 0
    bar = tqdm(total=max_steps, initial=step, disable=not progress, dynamic_ncols=True, desc="train")
    stopped_early = False
    while step < last_stop:
        mult = lr_at(step, max_steps, sched.warmup_steps, sched.min_lr_ratio)
        out, grad_norm = run.step(step, position, mult)
        step += 1
        position += bs
        tokens_run += bs * seq_len
        elapsed = time.time() - t_start
        record = _train_record(
            step, cfg.optim.lr * mult, out, grad_norm, tokens_run / max(elapsed, 1e-9), position
        )
        _append_log(run.log_path, record)
        _show_step(bar, record, run.ceiling)
        if calibrate_at is not None and step == calibrate_at:
            max_steps = run.fit_budget(step, step - start_step, t_start, max_steps, bar)
            last_stop = max_steps if stop_at_step is None else min(max_steps, stop_at_step)
            calibrate_at = None
        timed_out = deadline is not None and time.time() > deadline
        done = step == last_stop or timed_out
        eval_due = heldout is not None and (step % cfg.eval.every == 0 or done)
        if step % cfg.checkpoint.every == 0 or done:
            ckpt_path = run.save(step, position, max_steps, eval_due)
        if eval_due:
            last_eval = run.evaluate(step, bar)
        if timed_out and step < last_stop:
            stopped_early = True
            bar.write(f"stop_after_minutes reached at step {step}; checkpoint saved")
            break
    bar.close()
    return TrainResult(step=step, checkpoint=ckpt_path, last_eval=last_eval, stopped_early=stopped_early)
