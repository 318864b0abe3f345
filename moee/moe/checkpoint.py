"""Training checkpoints that resume exactly and never unpickle anything.

A checkpoint is a directory `step_XXXXXXXX/` holding
- the model in transformers format (`config.json`, `model.safetensors`), so any checkpoint
  loads with `AutoModelForCausalLM.from_pretrained` after `import moee.moe.lm`;
- `optimizer.safetensors`: every optimizer state tensor, keyed `state.<param>.<name>`;
- `rng.safetensors`: the torch CPU generator state (the gates' noise and any sampling);
- `trainer_state.json`: step, data position, optimizer hyper-parameters (param groups), the
  training config, and the SHA-256 of every file above.

It is written to a temporary directory and renamed into place, so a crash mid-save leaves
no half checkpoint under the final name. Loading verifies every hash first: a truncated or
corrupt file raises `ValueError` naming the file instead of failing deep inside torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

STATE_FILE = "trainer_state.json"
MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


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
    """Write `directory/step_{step:08d}` atomically; keep only the newest `keep` checkpoints."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp_step_{step:08d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    model.save_pretrained(tmp)
    tensors, groups = optimizer_to_tensors(optimizer)
    save_file(tensors, str(tmp / OPTIM_FILE))
    save_file({"torch_cpu": torch.get_rng_state()}, str(tmp / RNG_FILE))
    files = {name: sha256_file(tmp / name) for name in (MODEL_FILE, OPTIM_FILE, RNG_FILE, "config.json")}
    state = {
        "step": int(step),
        "data_position": int(data_position),
        "param_groups": groups,
        "config": config,
        "files": files,
        "torch_version": torch.__version__,
        **(extra or {}),
    }
    (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    if keep is not None and keep > 0:
        for old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under `directory`, oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [
        p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name) and (p / STATE_FILE).exists()
    ]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    found = list_checkpoints(directory)
    return found[-1] if found else None


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
    for key in ("step", "data_position", "param_groups", "files"):
        if key not in state:
            raise ValueError(f"checkpoint file {state_path} is corrupt: missing {key!r}")
    for name, digest in state["files"].items():
        fpath = path / name
        if not fpath.exists():
            raise ValueError(f"checkpoint file {fpath} is missing")
        if sha256_file(fpath) != digest:
            raise ValueError(f"checkpoint file {fpath} is corrupt or truncated (SHA-256 mismatch)")
    return state


def load_checkpoint(
    path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> dict:
    """Restore model weights, optimizer state and the torch RNG from `path`; return the trainer state."""
    path = Path(path)
    state = read_state(path)
    weights = _load_safetensors(path / MODEL_FILE)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = (
        set(getattr(model, "_tied_weights_keys", None) or {}) if model.config.tie_word_embeddings else set()
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
