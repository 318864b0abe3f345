"""Train `MoEEForCausalLM` from a JSON config: data, schedule, eval, checkpoints, exact resume.

Config format (JSON; every section optional except `model` and `data`; unknown keys are errors)::

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
                "router_lr_scale": 1.0},  # router weights train at lr * router_lr_scale
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

Logs: `<checkpoint.dir>/log.jsonl`, one JSON object per step (`"kind": "train"`) and per
evaluation (`"kind": "eval"`, with per-layer load statistics on the held-out windows).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moee.moe.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from moee.moe.layer import balance_stats

DEFAULTS: dict[str, Any] = {
    "seed": 0,
    "threads": None,
    "model": {},
    "data": {"train": None, "heldout": None, "tokenizer": None, "seq_len": 256, "cache_dir": "build/tokens"},
    "optim": {
        "lr": 3e-3,
        "betas": [0.9, 0.95],
        "eps": 1e-8,
        "weight_decay": 0.1,
        "grad_clip": 1.0,
        "batch_size": 16,
        "router_lr_scale": 1.0,
    },
    "schedule": {"max_steps": 1000, "warmup_steps": 50, "min_lr_ratio": 0.1, "time_budget_minutes": None},
    "eval": {"every": 100, "max_windows": 256, "batch_size": 16},
    "checkpoint": {"dir": "build/train", "every": 100, "keep": 2},
    "stop_after_minutes": None,
}


class NonFiniteLossError(FloatingPointError):
    """The training loss became NaN or infinite; training stops at that step."""


def load_config(source: str | os.PathLike | dict) -> dict:
    """Read a training config (path or dict), fill defaults, and validate names and types."""
    if isinstance(source, dict):
        user = copy.deepcopy(source)
        origin = "config"
    else:
        path = Path(source)
        if not path.exists():
            raise FileNotFoundError(f"training config {path} not found")
        try:
            user = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"training config {path} is not valid JSON: {exc}") from exc
        origin = str(path)
    if not isinstance(user, dict):
        raise ValueError(f"{origin}: the top level must be a JSON object")
    unknown = set(user) - set(DEFAULTS) - {"_comment"}
    if unknown:
        raise ValueError(f"{origin}: unknown section(s) {sorted(unknown)}; expected {sorted(DEFAULTS)}")
    cfg = copy.deepcopy(DEFAULTS)
    for key, value in user.items():
        if key == "_comment":
            continue
        if isinstance(DEFAULTS[key], dict) and key != "model":
            if not isinstance(value, dict):
                raise ValueError(f"{origin}: section {key!r} must be an object")
            bad = set(value) - set(DEFAULTS[key])
            if bad:
                raise ValueError(
                    f"{origin}: unknown key(s) {sorted(bad)} in {key!r}; expected {sorted(DEFAULTS[key])}"
                )
            cfg[key].update(value)
        else:
            cfg[key] = value
    for name in ("train", "tokenizer"):
        if not cfg["data"][name]:
            raise ValueError(f"{origin}: data.{name} is required")
    for section, key in (("optim", "batch_size"), ("data", "seq_len"), ("schedule", "max_steps")):
        value = cfg[section][key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{origin}: {section}.{key} must be a positive integer, got {value!r}")
    if not cfg["optim"]["lr"] > 0:
        raise ValueError(f"{origin}: optim.lr must be > 0")
    if cfg["schedule"]["warmup_steps"] < 0 or not 0 <= cfg["schedule"]["min_lr_ratio"] <= 1:
        raise ValueError(f"{origin}: schedule.warmup_steps must be >= 0 and min_lr_ratio in [0, 1]")
    return cfg


def lr_at(step: int, max_steps: int, warmup_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the base lr at 0-based `step`: linear warmup, then cosine decay to min_lr_ratio."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


# ----------------------------------------------------------------------------- data


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def iter_jsonl_texts(path: str | os.PathLike):
    """Yield the "text" of every line of a JSONL file; a bad line raises ValueError with its number."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: invalid JSON: {exc}") from exc
            text = record.get("text") if isinstance(record, dict) else None
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
    tok_digest = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()
    key = hashlib.sha256((_file_digest(jsonl) + tok_digest).encode()).hexdigest()[:16]
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    out = cache / f"{jsonl.stem}-{key}.u16"
    meta_path = out.with_suffix(".json")
    if out.exists() and meta_path.exists():
        return out
    tmp = out.with_suffix(".tmp")
    n_tokens = n_docs = 0
    with open(tmp, "wb") as f:
        batch: list[str] = []

        def flush() -> None:
            nonlocal n_tokens, n_docs
            ids = tokenizer(batch, add_special_tokens=False)["input_ids"]
            flat = np.fromiter((t for doc in ids for t in (*doc, eos)), dtype=np.uint16)
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
    os.replace(tmp, out)
    meta = {"source": str(jsonl), "n_tokens": n_tokens, "n_docs": n_docs, "eos": eos, "vocab": len(tokenizer)}
    meta_path.write_text(json.dumps(meta, indent=2))
    return out


def load_tokens(path: str | os.PathLike) -> np.ndarray:
    return np.memmap(path, dtype=np.uint16, mode="r")


class WindowSampler:
    """Deterministic batches of contiguous `seq_len` windows from a flat token stream.

    Window i covers tokens [i*seq_len, (i+1)*seq_len). Epoch e visits the windows in the
    permutation drawn from `numpy.random.default_rng([seed, e])`; `position` counts windows
    consumed so far, which is all a checkpoint needs to resume the data stream exactly.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int):
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.n_windows = len(tokens) // seq_len
        if self.n_windows < 1:
            raise ValueError(f"the corpus has {len(tokens)} tokens, fewer than one window of {seq_len}")
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    def _perm_for(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
            self._perm_epoch = epoch
        return self._perm

    def batch(self, position: int, batch_size: int) -> torch.Tensor:
        rows = []
        for pos in range(position, position + batch_size):
            epoch, offset = divmod(pos, self.n_windows)
            w = int(self._perm_for(epoch)[offset])
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


@torch.no_grad()
def evaluate(model: torch.nn.Module, windows: torch.Tensor, batch_size: int) -> dict:
    """Held-out LM loss/perplexity and per-layer load statistics in eval mode (no gate noise).

    Load is the count of top-k selections per expert over all held-out tokens; CV uses the
    population std; max/mean is the heaviest expert's load over the mean load.
    """
    was_training = model.training
    model.eval()
    total_nll = 0.0
    total_tokens = 0
    loads: list[torch.Tensor] | None = None
    importance: list[torch.Tensor] | None = None
    for start in range(0, len(windows), batch_size):
        batch = windows[start : start + batch_size]
        out = model(input_ids=batch, labels=batch)
        n = batch.shape[0] * (batch.shape[1] - 1)
        total_nll += out.lm_loss.item() * n
        total_tokens += n
        if loads is None:
            loads = [a["load"].clone() for a in out.moe_aux]
            importance = [a["importance"].clone() for a in out.moe_aux]
        else:
            for i, a in enumerate(out.moe_aux):
                loads[i] += a["load"]
                importance[i] += a["importance"]
    model.train(was_training)
    loss = total_nll / total_tokens
    layers = []
    for load, imp in zip(loads or [], importance or []):
        stats = balance_stats(imp.float(), load.float())
        layers.append(
            {
                "cv_load": float(stats["cv_load"]),
                "max_over_mean_load": float(stats["max_over_mean_load"]),
                "cv_importance": float(stats["cv_importance"]),
                "load": load.tolist(),
            }
        )
    return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": total_tokens, "layers": layers}


@torch.no_grad()
def calibrate_router_biases(
    model: torch.nn.Module, sampler: WindowSampler, position: int, batch_size: int, steps: int, gamma: float
) -> int:
    """Settle the selection biases of loss-free gates with all weights frozen.

    Runs `steps` forward passes over training windows (from data `position`) in train mode,
    so each `LossFreeBalancedGate` applies its own update rule, with the bias step decaying
    linearly from `gamma` to 0. A constant step leaves the final bias anywhere within about one
    step of the balance point; the decay lets it settle. Returns the new data position.
    """
    from moee.moe.gates import LossFreeBalancedGate

    gates = [m for m in model.modules() if isinstance(m, LossFreeBalancedGate)]
    if not gates or steps <= 0:
        return position
    if not gamma > 0:
        raise ValueError(f"calibration gamma must be > 0, got {gamma}")
    was_training = model.training
    saved = [(g.gamma, g.auto_update) for g in gates]
    model.train()
    try:
        for t in range(steps):
            for g in gates:
                g.gamma, g.auto_update = gamma * (1.0 - t / steps), True
            model(input_ids=sampler.batch(position, batch_size))
            position += batch_size
    finally:
        for g, (gm, auto) in zip(gates, saved):
            g.gamma, g.auto_update = gm, auto
        model.train(was_training)
    return position


# ----------------------------------------------------------------------------- training


@dataclass
class TrainResult:
    step: int
    checkpoint: Path | None
    last_eval: dict | None
    stopped_early: bool


def _build_model(cfg: dict, tokenizer: Any):
    from moee.moe.lm import MoEEConfig, MoEEForCausalLM

    kwargs = dict(cfg["model"])
    kwargs.setdefault("vocab_size", len(tokenizer))
    kwargs.setdefault("eos_token_id", tokenizer.eos_token_id)
    kwargs.setdefault("bos_token_id", tokenizer.bos_token_id)
    kwargs.setdefault("pad_token_id", tokenizer.pad_token_id)
    kwargs.setdefault("max_position_embeddings", cfg["data"]["seq_len"])
    if kwargs["vocab_size"] < len(tokenizer):
        raise ValueError(f"model.vocab_size {kwargs['vocab_size']} < tokenizer size {len(tokenizer)}")
    torch.manual_seed(cfg["seed"])
    return MoEEForCausalLM(MoEEConfig(**kwargs))


def _append_log(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _truncate_log(path: Path, step: int) -> None:
    """Drop log records after `step` (written by a run that died after its last checkpoint)."""
    if not path.exists():
        return
    kept = [
        line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step
    ]
    path.write_text("".join(line + "\n" for line in kept))


def train(
    config: str | os.PathLike | dict,
    *,
    resume: bool = False,
    stop_at_step: int | None = None,
    progress: bool = True,
) -> TrainResult:
    """Run (or resume) training as described by `config`; return the final step and checkpoint.

    `stop_at_step` ends the run after that step with a checkpoint, as if interrupted (used to
    test exact resume); the schedule still follows `schedule.max_steps`.
    """
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    cfg = load_config(config)
    if cfg["threads"]:
        torch.set_num_threads(int(cfg["threads"]))
    data, optim_cfg, sched, ev, ck = (
        cfg["data"],
        cfg["optim"],
        cfg["schedule"],
        cfg["eval"],
        cfg["checkpoint"],
    )
    out_dir = Path(ck["dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / "log.jsonl"

    tokenizer = AutoTokenizer.from_pretrained(data["tokenizer"])
    train_tokens = load_tokens(tokenize_to_file(data["train"], tokenizer, data["cache_dir"]))
    sampler = WindowSampler(train_tokens, data["seq_len"], cfg["seed"])
    heldout = None
    if data["heldout"]:
        heldout = eval_windows(
            load_tokens(tokenize_to_file(data["heldout"], tokenizer, data["cache_dir"])),
            data["seq_len"],
            ev["max_windows"],
        )

    model = _build_model(cfg, tokenizer)
    model.train()
    # Adam moves every router weight by ~lr per step whatever its gradient scale, which can make
    # all tokens pick the same experts faster than balancing reacts; router_lr_scale slows it.
    groups: dict[tuple[bool, bool], list] = {}
    for n, p in model.named_parameters():
        is_router = ".mlp.gate." in n
        decays = p.dim() >= 2 and not is_router
        groups.setdefault((is_router, decays), []).append(p)
    param_groups = [
        {
            "params": params,
            "weight_decay": optim_cfg["weight_decay"] if decays else 0.0,
            "lr_scale": optim_cfg["router_lr_scale"] if is_router else 1.0,
        }
        for (is_router, decays), params in sorted(groups.items())
    ]
    optimizer = torch.optim.AdamW(
        param_groups,
        lr=optim_cfg["lr"],
        betas=tuple(optim_cfg["betas"]),
        eps=optim_cfg["eps"],
    )

    step = 0
    position = 0
    max_steps = sched["max_steps"]
    budget = sched["time_budget_minutes"]
    calibrate_at = max(1, min(20, sched["warmup_steps"])) if budget else None
    if resume:
        ckpt = latest_checkpoint(out_dir)
        if ckpt is None:
            raise FileNotFoundError(f"--resume: no checkpoint found in {out_dir}")
        state = load_checkpoint(ckpt, model, optimizer)
        step, position = state["step"], state["data_position"]
        max_steps = state.get("max_steps", max_steps)
        if budget and step >= (calibrate_at or 0):
            calibrate_at = None  # already resolved by the interrupted run
        _truncate_log(log_path, step)
    else:
        torch.manual_seed(cfg["seed"] + 1)  # training-time randomness (gate noise) after the init draw
        if log_path.exists():
            log_path.unlink()

    last_stop = max_steps if stop_at_step is None else min(max_steps, stop_at_step)
    start_step = step
    bs, seq_len = optim_cfg["batch_size"], data["seq_len"]
    deadline = time.time() + 60 * cfg["stop_after_minutes"] if cfg["stop_after_minutes"] else None
    last_eval = None
    ckpt_path = None
    t_start = time.time()
    tokens_run = 0
    bar = tqdm(total=max_steps, initial=step, disable=not progress, dynamic_ncols=True, desc="train")
    stopped_early = False
    while step < last_stop:
        mult = lr_at(step, max_steps, sched["warmup_steps"], sched["min_lr_ratio"])
        for group in optimizer.param_groups:
            group["lr"] = optim_cfg["lr"] * mult * group["lr_scale"]
        batch = sampler.batch(position, bs)
        out = model(input_ids=batch, labels=batch)
        loss = out.loss
        if not torch.isfinite(loss):
            raise NonFiniteLossError(
                f"non-finite training loss ({loss.item()}) at step {step + 1}; stopping "
                f"(last checkpoint: {latest_checkpoint(out_dir)})"
            )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), optim_cfg["grad_clip"])
        optimizer.step()
        step += 1
        position += bs
        tokens_run += bs * seq_len
        elapsed = time.time() - t_start
        cv = [float(a["cv_load"]) for a in out.moe_aux]
        mm = [float(a["max_over_mean_load"]) for a in out.moe_aux]
        lm = out.lm_loss.item()
        record = {
            "kind": "train",
            "step": step,
            "lr": optim_cfg["lr"] * mult,
            "loss": loss.item(),
            "lm_loss": lm,
            "aux_loss": out.aux_loss.item(),
            "ppl": math.exp(min(lm, 50.0)),
            "grad_norm": float(grad_norm),
            "cv_load_mean": sum(cv) / max(1, len(cv)),
            "max_over_mean_load_max": max(mm, default=0.0),
            "tokens_per_s": tokens_run / max(elapsed, 1e-9),
            "data_position": position,
        }
        _append_log(log_path, record)
        bar.update(1)
        bar.set_postfix(
            loss=f"{lm:.3f}",
            ppl=f"{record['ppl']:.1f}",
            cv_load=f"{record['cv_load_mean']:.2f}",
            max_mean=f"{record['max_over_mean_load_max']:.2f}",
            tok_s=f"{record['tokens_per_s']:.0f}",
        )
        if calibrate_at is not None and step == calibrate_at:
            per_step = (time.time() - t_start) / max(1, step - start_step)
            fit = step + int((60 * budget - (time.time() - t_start)) * 0.92 / per_step)
            max_steps = max(step + 1, min(max_steps, fit))
            last_stop = max_steps if stop_at_step is None else min(max_steps, stop_at_step)
            bar.total = max_steps
            bar.write(f"time budget {budget} min at {per_step:.2f} s/step: max_steps = {max_steps}")
            _append_log(
                log_path, {"kind": "schedule", "step": step, "max_steps": max_steps, "s_per_step": per_step}
            )
            calibrate_at = None
        timed_out = deadline is not None and time.time() > deadline
        done = step == last_stop or timed_out
        if step % ck["every"] == 0 or done:
            ckpt_path = save_checkpoint(
                out_dir,
                step=step,
                model=model,
                optimizer=optimizer,
                data_position=position,
                config=cfg,
                extra={"max_steps": max_steps},
                keep=ck["keep"],
            )
        if heldout is not None and (step % ev["every"] == 0 or done):
            last_eval = evaluate(model, heldout, ev["batch_size"])
            _append_log(log_path, {"kind": "eval", "step": step, **last_eval})
            worst = max((layer["max_over_mean_load"] for layer in last_eval["layers"]), default=0.0)
            bar.write(
                f"step {step}: held-out loss {last_eval['loss']:.4f} ppl {last_eval['ppl']:.2f} max/mean {worst:.2f}"
            )
        if timed_out and step < last_stop:
            stopped_early = True
            bar.write(f"stop_after_minutes reached at step {step}; checkpoint saved")
            break
    bar.close()
    return TrainResult(step=step, checkpoint=ckpt_path, last_eval=last_eval, stopped_early=stopped_early)
