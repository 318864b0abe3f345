"""Where a model loaded for large-model inference expects its inputs.

With ``device_map`` (``"auto"`` or an explicit map), accelerate spreads a model over GPUs, the CPU
and disk: offloaded weights sit on the ``meta`` device and are copied in by a hook just before
their module runs. ``next(model.parameters()).device`` is then often ``meta`` (or a device that
is not where the first layer runs), and a batch moved there cannot be used. The input embedding
knows the right answer: its accelerate hook's ``execution_device`` is where token ids are looked
up, which is where ``input_ids``/``attention_mask`` must go.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["input_device"]


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
