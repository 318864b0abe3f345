"""Loading model weights (safetensors only), and where a loaded model expects its inputs.

:func:`load_causal_lm` is the one place moee reads model weights. It passes
``use_safetensors=True``: a pickled ``pytorch_model.bin`` can run code when it is unpickled, so a
model that ships only pickle weights is refused with a clear error unless the caller opts in
(``allow_pickle_weights=True``, CLI ``--allow-bin``) for a checkpoint they trust.

With ``device_map`` (``"auto"`` or an explicit map), accelerate spreads a model over GPUs, the CPU
and disk: offloaded weights sit on the ``meta`` device and are copied in by a hook just before
their module runs. ``next(model.parameters()).device`` is then often ``meta`` (or a device that
is not where the first layer runs), and a batch moved there cannot be used. The input embedding
knows the right answer: its accelerate hook's ``execution_device`` is where token ids are looked
up, which is where ``input_ids``/``attention_mask`` must go.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["input_device", "load_causal_lm"]

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def _pickle_only(path: Path) -> list[str]:
    """Names of the pickle weight files of a local model directory that has no safetensors."""
    if any(path.glob("*.safetensors")) or any(path.glob("*.safetensors.index.json")):
        return []
    return sorted(p.name for p in path.iterdir() if p.suffix in _PICKLE_SUFFIXES)


def load_causal_lm(
    name_or_path: str | Path,
    *,
    trust_remote_code: bool = False,
    allow_pickle_weights: bool = False,
    **hf_kwargs: Any,
) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained`` with safetensors weights only (see module doc).

    ``allow_pickle_weights=True`` lets transformers fall back to a ``.bin`` checkpoint; other
    keywords (``dtype``, ``device_map``, ``quantization_config`` ...) pass through.
    """
    from transformers import AutoModelForCausalLM

    if "use_safetensors" in hf_kwargs:
        raise ValueError("pass allow_pickle_weights=True instead of use_safetensors")
    local = Path(name_or_path)
    if not allow_pickle_weights and local.is_dir():
        pickled = _pickle_only(local)
        if pickled:
            raise ValueError(
                f"{local} has no safetensors weights, only pickle files ({', '.join(pickled)}); moee "
                "loads safetensors only because unpickling can run code. If you trust this "
                "checkpoint, pass allow_pickle_weights=True (CLI: --allow-bin), or convert it to "
                "safetensors with save_pretrained"
            )
    return AutoModelForCausalLM.from_pretrained(
        str(name_or_path),
        trust_remote_code=trust_remote_code,
        use_safetensors=None if allow_pickle_weights else True,
        **hf_kwargs,
    )


def _execution_device(module: nn.Module) -> torch.device | None:
    hook = getattr(module, "_hf_hook", None)
    # accelerate's AlignDevicesHook, possibly inside a SequentialHook
    for h in getattr(hook, "hooks", None) or ([hook] if hook is not None else []):
        device = getattr(h, "execution_device", None)
        if device is not None:
            return torch.device(device) if not isinstance(device, torch.device) else device
    return None


def input_device(model: nn.Module) -> torch.device:
    """The device a batch of token ids must be on for ``model``'s forward.

    Order: the accelerate execution device of the input embedding (dispatched models), else the
    device of the input embedding's weight, else the model's own execution device, else the
    device of the first parameter that is not on ``meta``, else the CPU.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    embed = None
    getter = getattr(model, "get_input_embeddings", None)
    if callable(getter):
        try:
            embed = getter()
        except NotImplementedError:
            embed = None
    if isinstance(embed, nn.Module):
        device = _execution_device(embed)
        if device is not None:
            return device
        for param in embed.parameters():
            if param.device.type != "meta":
                return param.device
    device = _execution_device(model)
    if device is not None:
        return device
    for param in model.parameters():
        if param.device.type != "meta":
            return param.device
    return torch.device("cpu")
