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

:class:`LoadOptions` is the one set of loading options (device, dtype, device_map, 4-bit,
remote code, pickle weights): each field declares its command-line flag beside itself
(``metadata``; ``moee.cli_options`` builds the flags from the fields), :func:`add_loading_arguments`
gives every command the same flags, :meth:`LoadOptions.from_args` reads them back, and
``MoEEmbedder.from_pretrained(name, options)`` is the one loader they all reach. A new option is
one field with its metadata.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where it is used, so the CLI parsers start without it
    import torch
    from torch import nn

__all__ = [
    "DTYPES",
    "LoadOptions",
    "add_loading_arguments",
    "four_bit_config",
    "input_device",
    "load_causal_lm",
]

#: Weight dtypes the CLI offers (``auto``: the checkpoint's own; none given: transformers' default).
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class LoadOptions:
    """How to load a model: where (``device`` or ``device_map``), in which ``dtype`` (a name of
    :data:`DTYPES`), in 4-bit NF4, with the repository's own code, from pickle weights.

    Frozen and checked on construction; :meth:`hf_kwargs` turns it into transformers keywords.
    """

    device: str | None = field(
        default=None, metadata={"help": "e.g. cpu, cuda, cuda:1", "default_text": "cuda if available"}
    )
    dtype: str | None = field(
        default=None, metadata={"help": "weights dtype", "choices": DTYPES, "default_text": "the model's"}
    )
    device_map: str | None = field(
        default=None,
        metadata={
            "help": "transformers device_map, e.g. auto: spread a large model over GPUs/CPU (instead of --device)"
        },
    )
    load_in_4bit: bool = field(
        default=False,
        metadata={
            "help": "4-bit NF4 weights via bitsandbytes (pip install 'moee[quant]'; needs a GPU), as in the paper"
        },
    )
    trust_remote_code: bool = field(
        default=False,
        metadata={
            "help": "allow custom modeling code from the model repository (off by default: it runs arbitrary code)"
        },
    )
    allow_pickle_weights: bool = field(
        default=False,
        metadata={
            "flag": "--allow-bin",
            "help": "also load pickled .bin weights (off by default: unpickling can run code; safetensors only)",
        },
    )

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; expected one of: {', '.join(DTYPES)}")
        if self.device is not None and self.device_map is not None:
            raise ValueError("give either --device or --device-map, not both")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LoadOptions:
        """The options of :func:`add_loading_arguments` from parsed arguments."""
        from moee.cli_options import load_options

        return load_options(args)

    def replace(self, **changes: Any) -> LoadOptions:
        """A copy with ``changes`` (checked again)."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def torch_dtype(self) -> Any:
        """``dtype`` as transformers' ``dtype=`` takes it (``"auto"``, a ``torch.dtype`` or ``None``)."""
        if self.dtype is None or self.dtype == "auto":
            return self.dtype
        import torch

        return getattr(torch, self.dtype)

    def hf_kwargs(self) -> dict[str, Any]:
        """The keywords for ``from_pretrained`` besides the device: dtype, device_map, 4-bit config."""
        kwargs: dict[str, Any] = {}
        if self.dtype is not None:
            kwargs["dtype"] = self.torch_dtype()
        if self.device_map is not None:
            kwargs["device_map"] = self.device_map
        if self.load_in_4bit:
            kwargs["quantization_config"] = four_bit_config()
        return kwargs


def add_loading_arguments(parser: argparse.ArgumentParser, *, model: bool = True) -> None:
    """The model-loading flags of every command, one per :class:`LoadOptions` field (read back with
    :meth:`LoadOptions.from_args`); ``model=True`` also adds ``--model``."""
    from moee.cli_options import add_loading_arguments as add

    add(parser, model=model)


def four_bit_config() -> Any:
    """NF4 with double quantisation and bf16 compute (the official code's setting)."""
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        raise ValueError("--load-in-4bit needs bitsandbytes: pip install 'moee[quant]' (on a CUDA machine)")
    import torch
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )


_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def _pickle_only(path: Path) -> list[str]:
    """Names of the pickle weight files of a local model directory that has no safetensors."""
    if any(path.glob("*.safetensors")) or any(path.glob("*.safetensors.index.json")):
        return []
    return sorted(p.name for p in path.iterdir() if p.suffix in _PICKLE_SUFFIXES)


def check_model_source(name_or_path: str | Path) -> None:
    """Refuse, by name, a model argument that is meant as a local path but is not a model directory.

    A Hub id is ``name`` or ``org/name``; anything absolute, starting with ``.`` or ``~``, or with
    more path parts is a local path, and transformers would otherwise misread a missing one as a
    malformed Hub id (a raw ``OSError``). Existing directories and Hub ids pass unchanged.
    """
    local = Path(name_or_path).expanduser()
    text = str(name_or_path)
    if local.is_dir():
        return
    if local.exists():
        raise NotADirectoryError(f"model {text!r} is a file; give a model directory or a Hub id")
    if local.is_absolute() or text.startswith((".", "~")) or len(Path(text).parts) > 2:
        raise FileNotFoundError(
            f"model directory {text!r} not found (and it is not a Hub id such as org/name)"
        )


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
    check_model_source(name_or_path)
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
    import torch

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
    import torch
    from torch import nn

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
