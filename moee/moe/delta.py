"""A trained upcycled model shipped as a small delta over its dense base, and its assembly.

Training an upcycled ``lora`` model (`moee.moe.upcycled`) with ``optim.trainable = "routed"`` moves
only the routers and the routed experts' adapters; the dense weights stay the base checkpoint's.
So the model is the base plus a few MB: `save_delta` writes those tensors (``delta.safetensors``),
the model's config and a manifest (``delta.json``: the sha256 of the delta, of the base weights it
fits, and of the assembled weights); `assemble` rebuilds the model from the base and the delta,
checks every digest, and caches the result as an ordinary model folder (weights, config, tokenizer
and every other file of the delta folder, such as ``moee_embedding.json``), so loading it later is
a plain ``from_pretrained``. The assembly is deterministic: the same base and delta give
bit-identical weights, which the recorded digest of the assembled weights checks.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moee.provenance import ASSEMBLED_STAMP, file_sha256

__all__ = [
    "DELTA_FILE",
    "MANIFEST_FILE",
    "assemble",
    "delta_state_dict",
    "manifest_digest",
    "routed_parameter_ids",
    "save_delta",
]

DELTA_FILE = "delta.safetensors"
MANIFEST_FILE = "delta.json"
FORMAT = "moee-delta/1"
_STAMP = ASSEMBLED_STAMP


def routed_parameter_ids(model: nn.Module) -> set[int]:
    """``id``s of the parameters of every router (a `moee.moe.layer.MoEERouter`'s gate, marked
    ``_moee_router_part``) and of every MoE layer's routed ``experts`` (not its shared expert):
    what ``optim.trainable = "routed"`` trains and a delta holds."""
    ids = {id(p) for m in model.modules() if getattr(m, "_moee_router_part", False) for p in m.parameters()}
    for module in model.modules():
        if hasattr(module, "router") and isinstance(getattr(module, "experts", None), nn.Module):
            ids.update(id(p) for p in module.experts.parameters())
    return ids


def delta_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The routed parameters (`routed_parameter_ids`) and the routers' saved buffers (a loss-free
    gate's selection bias) by state-dict name, detached and contiguous."""
    keep = routed_parameter_ids(model)
    out = {name: p for name, p in model.named_parameters() if id(p) in keep}
    for name, module in model.named_modules():
        if getattr(module, "_moee_router_part", False):
            for buf_name, buf in module.named_buffers(recurse=False):
                if buf_name not in module._non_persistent_buffers_set:
                    out[f"{name}.{buf_name}"] = buf
    return {k: v.detach().contiguous().clone() for k, v in sorted(out.items())}


def save_delta(
    model: Any, folder: str | os.PathLike, base: dict[str, str], dtype: torch.dtype | None = None
) -> Path:
    """Write ``model``'s delta (`delta_state_dict`), its config and ``delta.json`` into ``folder``
    (created; existing delta files replaced, other files kept). ``base`` names the dense weights it
    fits: ``{"source": ..., "weights_sha256": ...}`` (the sha256 of the base's model.safetensors).
    ``dtype`` stores the floating tensors rounded to it (e.g. float16: half the bytes); the model
    assembled from the delta computes in its own dtype with the rounded values, so measure that
    model (`build_from_delta`), not the one saved."""
    from safetensors.torch import save_file

    from moee.io import write_json_atomic

    if not {"source", "weights_sha256"} <= set(base):
        raise ValueError(f"base must name 'source' and 'weights_sha256', got {sorted(base)}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = delta_state_dict(model)
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    save_file(tensors, folder / DELTA_FILE, metadata={"format": "pt"})
    os.chmod(folder / DELTA_FILE, folder.stat().st_mode & 0o666)  # safetensors writes 0600
    model.config.to_json_file(folder / "config.json")
    manifest = {
        "format": FORMAT,
        "base": dict(base),
        "delta_sha256": file_sha256(folder / DELTA_FILE),
        "delta_dtype": str(dtype or next(iter(tensors.values())).dtype).replace("torch.", ""),
        "model_class": type(model).__name__,
    }
    write_json_atomic(folder / MANIFEST_FILE, manifest)
    return folder


def _read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / MANIFEST_FILE
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{folder} holds no {MANIFEST_FILE}: not a model delta") from None
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc})") from exc
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    found = file_sha256(folder / DELTA_FILE)
    if found != manifest.get("delta_sha256"):
        raise ValueError(
            f"{folder / DELTA_FILE} has sha256 {found}, but {MANIFEST_FILE} records "
            f"{manifest.get('delta_sha256')}: the delta changed after it was written; restore it (git checkout)"
        )
    return manifest


def manifest_digest(folder: str | os.PathLike) -> str:
    """The sha256 of the delta in ``folder``, checked against its file (what names its assembled cache)."""
    return _read_manifest(Path(folder))["delta_sha256"]


def _companions(folder: Path) -> list[Path]:
    """The files of a delta folder an assembled folder copies as they are (its embedding
    configuration, reference statistics, model card ...): every file but the delta, its manifest
    and the config (which the assembled model writes itself)."""
    return sorted(
        item
        for item in folder.iterdir()
        if item.is_file() and item.name not in (DELTA_FILE, MANIFEST_FILE, "config.json")
    )


def _companions_digest(folder: Path) -> str:
    """One sha256 over the companions' names and contents: an assembled folder whose copies differ
    from the delta folder's files (a changed ``moee_embedding.json``, a refitted reference) is
    rebuilt, never reused with the old configuration."""
    digest = hashlib.sha256()
    for item in _companions(folder):
        digest.update(f"{item.name}\0{file_sha256(item)}\n".encode())
    return digest.hexdigest()


def _stamp_matches(out: Path, manifest: dict[str, Any], folder: Path) -> bool:
    try:
        stamp = json.loads((out / _STAMP).read_text())
        return (
            stamp.get("delta_sha256") == manifest["delta_sha256"]
            and stamp.get("companions_sha256") == _companions_digest(folder)
            and file_sha256(out / "model.safetensors") == stamp.get("model_sha256")
        )
    except (OSError, ValueError, KeyError):
        return False


def build_from_delta(folder: str | os.PathLike, base: str | os.PathLike) -> Any:
    """The model of the delta in ``folder`` on the dense checkpoint ``base`` (a folder), in memory:
    the dense FFNs become each layer's shared expert, the delta fills routers and adapters."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from moee.moe.upcycled import MoEEUpcycledConfig, MoEEUpcycledForCausalLM, family_rule, moe_layers

    folder = Path(folder)
    _read_manifest(folder)
    config = MoEEUpcycledConfig.from_pretrained(folder)
    if config.upcycle_mode != "lora":
        raise ValueError(f"{folder}: a delta rebuilds a 'lora' upcycled model, not {config.upcycle_mode!r}")
    dense = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, use_safetensors=True)
    rule = family_rule(dense.config.model_type)
    ffns = [rule.read(layer) for layer in moe_layers(dense.base_model, rule)]
    model = MoEEUpcycledForCausalLM(config, dense=dense)
    for moe, ffn in zip(model.moe_ffns(), ffns, strict=True):
        moe.load_dense(
            ffn,
            None,
            torch.arange(ffn.d_ff),
            torch.zeros(config.num_experts, ffn.d_model),
            torch.zeros_like(moe.experts.lora_a),
        )
    delta = load_file(folder / DELTA_FILE)
    expected = delta_state_dict(model)
    if set(delta) != set(expected):
        missing, extra = sorted(set(expected) - set(delta)), sorted(set(delta) - set(expected))
        raise ValueError(
            f"{folder / DELTA_FILE} does not fit its config: missing {missing[:3]}, unexpected {extra[:3]}"
        )
    state = model.state_dict()
    with torch.no_grad():
        for name, tensor in delta.items():
            if state[name].shape != tensor.shape:
                raise ValueError(
                    f"{name}: delta shape {tuple(tensor.shape)}, model {tuple(state[name].shape)}"
                )
            state[name].copy_(tensor)
    model.eval()
    return model


def assemble(
    folder: str | os.PathLike,
    base: str | os.PathLike,
    out: str | os.PathLike,
) -> Path:
    """The model folder of the delta in ``folder`` on ``base``, built into ``out`` once (staged,
    committed by rename) and reused while its weights' digest holds. The assembled weights must
    have the digest ``delta.json`` records (``model_sha256``, when recorded): a build that is not
    bit-exact is an error, never a silently different model."""
    from transformers import AutoTokenizer

    from moee.io import build_cache_folder, check_rebuildable

    folder, out = Path(folder), Path(out)
    manifest = _read_manifest(folder)
    if _stamp_matches(out, manifest, folder):
        return out
    check_rebuildable(out, _STAMP)
    recorded_base = manifest["base"].get("weights_sha256")
    found_base = file_sha256(Path(base) / "model.safetensors")
    if recorded_base != found_base:
        raise ValueError(
            f"the delta in {folder} fits base weights {recorded_base}, but {base} has {found_base}: "
            f"rebuild the base ({manifest['base'].get('source')})"
        )
    model = build_from_delta(folder, base)

    def fill(staging: Path) -> dict[str, Any]:
        model.save_pretrained(staging)
        AutoTokenizer.from_pretrained(base).save_pretrained(staging)
        for item in _companions(folder):
            shutil.copy2(item, staging / item.name)
        model_sha = file_sha256(staging / "model.safetensors")
        want = manifest.get("model_sha256")
        if want is not None and want != model_sha:
            raise RuntimeError(
                f"assembling {folder} on {base} gave weights {model_sha}, not the recorded {want}: "
                "the build is not bit-exact on this machine (report it with your torch version)"
            )
        return {
            "delta_sha256": manifest["delta_sha256"],
            "companions_sha256": _companions_digest(folder),
            "model_sha256": model_sha,
            "base": manifest["base"],
        }

    return build_cache_folder(out, _STAMP, fill)
