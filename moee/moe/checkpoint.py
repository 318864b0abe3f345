"""Training checkpoints that resume exactly and never unpickle anything.

A checkpoint is a directory `step_XXXXXXXX/` holding
- the model in transformers format (`config.json`, `model.safetensors`), so any checkpoint
  loads with `AutoModelForCausalLM.from_pretrained` after `import moee`, and wherever moee takes a
  model (`moee.loading.load_model`: its tokenizer is the one the run names, `moee.loading.run_tokenizer`);
- `optimizer.safetensors`: every optimizer state tensor, keyed `state.<param>.<name>`;
- `rng.safetensors`: the torch CPU generator state (the gates' noise and any sampling);
- `trainer_state.json`: step, data position, optimizer hyper-parameters (param groups), the
  training config, the SHA-256 of every file above, and the SHA-256 of the state itself
  (`state_sha256`, over its canonical JSON without that key).

It is written to a temporary directory and renamed into place, so a crash mid-save leaves
no half checkpoint under the final name, and it is never written with a NaN or infinite
weight or optimizer moment (`NonFiniteCheckpointError`). Pruning only removes checkpoints
older than the one just written. Loading verifies the state hash, that every listed file is
a plain name inside the checkpoint directory, and every file hash first: a truncated,
altered or foreign file raises `ValueError` naming the file instead of failing deep inside
torch or resuming from a silently different state.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from moee.io import match_folder_modes
from moee.loading import CHECKPOINT_STATE_FILE

STATE_FILE = CHECKPOINT_STATE_FILE  # the loader reads the run's tokenizer from it
MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"
CONFIG_FILE = "config.json"
REQUIRED_FILES = (MODEL_FILE, OPTIM_FILE, RNG_FILE, CONFIG_FILE)
STATE_FORMAT = 2  # 1: no state hash (older checkpoints)
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_ANY_STEP_DIR = re.compile(r"^(\.tmp_)?step_\d{8}$")


class NonFiniteCheckpointError(FloatingPointError):
    """A weight or optimizer state tensor is NaN or infinite; such a checkpoint is never written."""


def sha256_file(path: str | os.PathLike) -> str:
    """``moee.provenance.file_sha256`` (the one file hash of every record), under its old name."""
    from moee.provenance import file_sha256

    return file_sha256(path)


def state_digest(state: dict) -> str:
    """SHA-256 of a trainer state's canonical JSON, without its own `state_sha256` entry."""
    body = {k: v for k, v in state.items() if k != "state_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _first_non_finite(tensors: dict[str, torch.Tensor]) -> str | None:
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return name
    return None


def optimizer_to_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Split an optimizer state_dict into flat tensors (safetensors) and JSON-able param groups."""
    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for pid, state in sd["state"].items():
        for name, value in state.items():
            t = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            tensors[f"state.{pid}.{name}"] = t.detach().cpu().contiguous()
    groups = []
    for g in sd["param_groups"]:
        groups.append({k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()})
    return tensors, groups


def optimizer_from_tensors(
    optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], groups: list[dict]
) -> None:
    """Inverse of `optimizer_to_tensors`: restore the state into `optimizer` in place."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        _, pid, name = key.split(".", 2)
        state.setdefault(int(pid), {})[name] = value
    current = optimizer.state_dict()["param_groups"]
    if len(current) != len(groups) or any(
        len(a["params"]) != len(b["params"]) for a, b in zip(current, groups)
    ):
        raise ValueError(
            "checkpoint optimizer does not match the model's parameters (different architecture?)"
        )
    restored = []
    for g in groups:
        g = dict(g)
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
        restored.append(g)
    optimizer.load_state_dict({"state": state, "param_groups": restored})


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, RuntimeError) as exc:
        raise ValueError(f"checkpoint file {path} is corrupt or truncated: {exc}") from exc


def save_checkpoint(
    directory: str | os.PathLike,
    *,
    step: int,
    model: Any,
    optimizer: torch.optim.Optimizer,
    data_position: int,
    config: dict,
    extra: dict | None = None,
    keep: int | None = None,
) -> Path:
    """Write `directory/step_{step:08d}` atomically and prune older checkpoints.

    Refuses (`NonFiniteCheckpointError`, nothing written) when a weight or optimizer state is
    NaN/inf. Pruning keeps the new checkpoint and the newest `keep - 1` checkpoints with a
    lower step; it never deletes the checkpoint just written, whatever else the directory holds.
    """
    tensors, groups = optimizer_to_tensors(optimizer)
    bad = _first_non_finite(dict(model.state_dict())) or _first_non_finite(tensors)
    if bad is not None:
        raise NonFiniteCheckpointError(
            f"{bad} holds NaN or infinite values; step {step} was not checkpointed"
        )
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp_step_{step:08d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    model.save_pretrained(tmp)
    save_file(tensors, str(tmp / OPTIM_FILE))
    save_file({"torch_cpu": torch.get_rng_state()}, str(tmp / RNG_FILE))
    state = {
        "format": STATE_FORMAT,
        "step": int(step),
        "data_position": int(data_position),
        "param_groups": groups,
        "config": config,
        "files": {name: sha256_file(tmp / name) for name in REQUIRED_FILES},
        "torch_version": torch.__version__,
        **(extra or {}),
    }
    state["state_sha256"] = state_digest(state)
    (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))
    match_folder_modes(tmp)  # safetensors writes 0600; a checkpoint is a model like any other
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    if keep is not None and keep > 0:
        older = [p for p in list_checkpoints(root) if _step_of(p) < step]
        for old in older[: max(0, len(older) - (keep - 1))]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _step_of(path: Path) -> int:
    return int(_STEP_DIR.match(path.name).group(1))


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under `directory`, oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [
        p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name) and (p / STATE_FILE).exists()
    ]
    return sorted(found, key=_step_of)


def checkpoint_dirs(directory: str | os.PathLike) -> list[Path]:
    """Every checkpoint directory under `directory`, complete or not (`step_*`, `.tmp_step_*`)."""
    root = Path(directory)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and _ANY_STEP_DIR.match(p.name))


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    found = list_checkpoints(directory)
    return found[-1] if found else None


def _check_file_names(state_path: Path, files: Any) -> None:
    """Every listed file must be a plain name inside the checkpoint, and the required ones listed."""
    if not isinstance(files, dict):
        raise ValueError(f"checkpoint file {state_path} is corrupt: 'files' is not an object")
    for name in files:
        if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name or "\\" in name:
            raise ValueError(
                f"checkpoint file {state_path} lists {name!r}, a path outside the checkpoint directory "
                f"{state_path.parent}; only plain file names inside it are accepted"
            )
    missing = [name for name in REQUIRED_FILES if name not in files]
    if missing:
        raise ValueError(f"checkpoint file {state_path} is corrupt: no hash for {missing}")


def read_state(path: str | os.PathLike) -> dict:
    """Read and verify `trainer_state.json` and the hashes of every file it lists."""
    path = Path(path)
    state_path = path / STATE_FILE
    if not state_path.exists():
        raise FileNotFoundError(f"{state_path} not found: {path} is not a complete checkpoint")
    try:
        state = json.loads(state_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"checkpoint file {state_path} is corrupt: {exc}") from exc
    if not isinstance(state, dict):
        raise ValueError(f"checkpoint file {state_path} is corrupt: not a JSON object")
    for key in ("step", "data_position", "param_groups", "files"):
        if key not in state:
            raise ValueError(f"checkpoint file {state_path} is corrupt: missing {key!r}")
    _check_file_names(state_path, state["files"])
    if "state_sha256" in state or "format" in state:
        if state.get("state_sha256") != state_digest(state):
            raise ValueError(f"checkpoint file {state_path} is corrupt or altered (state SHA-256 mismatch)")
    else:  # written before the state was hashed: a single damaged key cannot make a new state look like this
        warnings.warn(
            f"{state_path} predates state hashing; its own contents are not integrity-checked",
            stacklevel=2,
        )
    for name, digest in state["files"].items():
        fpath = path / name
        if fpath.is_symlink():
            raise ValueError(f"checkpoint file {fpath} is a symbolic link (possibly outside the checkpoint)")
        if not fpath.exists():
            raise ValueError(f"checkpoint file {fpath} is missing")
        if sha256_file(fpath) != digest:
            raise ValueError(f"checkpoint file {fpath} is corrupt or truncated (SHA-256 mismatch)")
    return state


def load_checkpoint(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    state: dict | None = None,
) -> dict:
    """Restore model weights, optimizer state and the torch RNG from `path`; return the trainer state.

    `state` is what `read_state(path)` returned when the caller already verified it.
    """
    path = Path(path)
    state = read_state(path) if state is None else state
    weights = _load_safetensors(path / MODEL_FILE)
    try:
        missing, unexpected = model.load_state_dict(weights, strict=False)
    except RuntimeError as exc:  # shape mismatch: another architecture
        raise ValueError(f"checkpoint file {path / MODEL_FILE} does not match the model: {exc}") from exc
    # transformers 5 lists every tied key in `all_tied_weights_keys` (nested models included, e.g. an
    # upcycled BERT's `model.cls.predictions.decoder.*`); `_tied_weights_keys` only the top model's
    tied = (
        set(getattr(model, "all_tied_weights_keys", None) or {})
        | set(getattr(model, "_tied_weights_keys", None) or {})
        if model.config.tie_word_embeddings
        else set()
    )
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ValueError(
            f"checkpoint file {path / MODEL_FILE} does not match the model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    if optimizer is not None:
        optimizer_from_tensors(optimizer, _load_safetensors(path / OPTIM_FILE), state["param_groups"])
    rng = _load_safetensors(path / RNG_FILE)
    if "torch_cpu" not in rng:
        raise ValueError(f"checkpoint file {path / RNG_FILE} is corrupt: no 'torch_cpu' state")
    torch.set_rng_state(rng["torch_cpu"])
    return state
