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

:class:`LoadOptions` is the one set of loading options (device, dtype, device_map, memory
budgets, offload folder, 4-bit, remote code, pickle weights, tokenizer): each field declares its command-line flag beside itself
(``metadata``; ``moee.cli_options`` builds the flags from the fields, so a new option is one field
with its metadata, and gives every command the same flags), :meth:`LoadOptions.from_args` reads
them back, and :func:`load_model` is the one loader every
command, ``MoEEmbedder.from_pretrained`` and the trainer's ``init.from`` reach. It registers every
model type moee defines (``moee.models.register_models``), reads ``name@revision``, loads the
weights with :func:`load_causal_lm`, places them, and finds the tokenizer (:func:`tokenizer_source`):
``LoadOptions.tokenizer`` when given, else the model folder's own, else, for a training checkpoint
(``moee train``'s ``run/step_XXXXXXXX/``, which holds no tokenizer), the one its run was trained
with (:func:`run_tokenizer`); an error names what is missing when none is found. The model that
loads when none is named is ``moee.models.bundled.DEFAULT_MODEL``; the small ``minilm-moe``, shipped
whole, lives in :data:`MINILM_MOE_DIR`.

A model larger than memory loads with ``--device-map auto --max-memory cpu=8GiB --offload-folder
DIR``: accelerate fills each device up to its budget (:func:`parse_max_memory`, read once when the
options are made) and puts the remaining layers in ``DIR``, read back just before each runs; the
capture hooks sit inside accelerate's, so the vectors are those of the model held in memory.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:  # torch is imported where it is used, so the CLI parsers start without it
    import torch
    from torch import nn

__all__ = [
    "MINILM_MOE_DIR",
    "DTYPES",
    "TOKENIZER_FILES",
    "Loaded",
    "LoadOptions",
    "TokenizerSource",
    "four_bit_config",
    "input_device",
    "load_causal_lm",
    "load_model",
    "parse_max_memory",
    "quantization_summary",
    "run_tokenizer",
    "split_revision",
    "tokenizer_source",
]

#: The folder of ``minilm-moe``, the small model shipped whole inside the package (trained by
#: ``scripts/train_default_model.sh``, exported by ``scripts/export_default_model.py``): what the
#: tests and quick tries load by name; its embedding configuration is its own ``moee_embedding.json``,
#: like any model folder's. The model that loads when none is named is ``moee.models.bundled.DEFAULT_MODEL``.
MINILM_MOE_DIR = Path(__file__).resolve().parent / "assets" / "default-model"
#: The state file of a training checkpoint (``moee.moe.checkpoint``), which names its run's tokenizer.
CHECKPOINT_STATE_FILE = "trainer_state.json"

#: Weight dtypes the CLI offers (``auto``: the checkpoint's own; none given: transformers' default).
DTYPES = ("auto", "float32", "bfloat16", "float16")

#: Byte multiples a ``--max-memory`` size may end in (any case; no unit: bytes).
_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SIZE_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)
_NAMED_DEVICES = ("cpu", "mps", "disk")
_MAX_MEMORY_FORM = (
    "give DEVICE=SIZE pairs joined by commas, e.g. --max-memory cpu=8GiB or --max-memory 0=20GiB,cpu=8GiB "
    "(DEVICE: a GPU index, cuda:N, cpu, mps or disk; SIZE: bytes, or a number with KB/MB/GB/TB or KiB/MiB/GiB/TiB)"
)


def _memory_size(device: object, size: object) -> int:
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise ValueError(
            f"--max-memory: the size of {device} must be a number of bytes or a text like 8GiB, got {size!r}"
        )
    if isinstance(size, int):
        if size < 0:
            raise ValueError(f"--max-memory: the size of {device} is negative ({size})")
        return size
    match = _SIZE.fullmatch(size)
    if match is None or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"--max-memory: cannot read the size {size!r} of {device}; {_MAX_MEMORY_FORM}")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def _memory_device(key: object) -> int | str:
    if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
        return key
    text = str(key).strip().lower() if isinstance(key, str) else ""
    if text.isdigit():
        return int(text)
    if text.startswith("cuda:") and text[5:].isdigit():
        return int(text[5:])  # accelerate numbers CUDA devices by index
    if text in _NAMED_DEVICES:
        return text
    raise ValueError(f"--max-memory: unknown device {key!r}; {_MAX_MEMORY_FORM}")


def parse_max_memory(value: str | Mapping[Any, Any] | None) -> dict[int | str, int] | None:
    """``--max-memory`` as accelerate's ``max_memory`` takes it: ``{device: bytes}`` from the flag's
    text (``"0=20GiB,cpu=8GiB"``) or from a mapping (``{"cpu": "8GiB"}``, ``{0: 2**34}``).

    GPUs are integers (``cuda:N`` is read as ``N``), the others ``cpu``, ``mps`` or ``disk``; sizes
    are bytes, decimal (``GB``) or binary (``GiB``) multiples, in any case (``gb`` is bytes here, not
    bits). The one place the flag is read, so every error names ``--max-memory`` and its form.
    """
    if value is None:
        return None
    if isinstance(value, str):
        pairs = []
        for item in value.split(","):
            device, sep, size = item.partition("=")
            if not sep or not device.strip() or not size.strip():
                raise ValueError(
                    f"--max-memory: cannot read {item.strip()!r} in {value!r}; {_MAX_MEMORY_FORM}"
                )
            pairs.append((device, size))
    elif isinstance(value, Mapping):
        pairs = list(value.items())
    else:
        raise ValueError(
            f"--max-memory must be a text or a mapping, got {type(value).__name__}; {_MAX_MEMORY_FORM}"
        )
    if not pairs:
        raise ValueError(f"--max-memory is empty; {_MAX_MEMORY_FORM}")
    parsed: dict[int | str, int] = {}
    for key, size in pairs:
        device = _memory_device(key)
        if device in parsed:
            raise ValueError(f"--max-memory names device {device!r} twice ({value!r}); give each device once")
        parsed[device] = _memory_size(device, size)
    return parsed


@dataclass(frozen=True)
class LoadOptions:
    """How to load a model: where (``device`` or ``device_map``), in which ``dtype`` (a name of
    :data:`DTYPES`), in 4-bit NF4, with the repository's own code, from pickle weights, and with
    which ``tokenizer`` (a directory or Hub id; ``None``: the model's own, or its training run's).

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
    max_memory: str | Mapping[Any, Any] | None = field(
        default=None,
        metadata={
            "metavar": "DEVICE=SIZE[,...]",
            "help": "with --device-map: the most each device may hold, e.g. cpu=8GiB or 0=20GiB,cpu=8GiB "
            "(devices: a GPU index, cpu, mps, disk; sizes in bytes, KB/MB/GB or KiB/MiB/GiB); "
            "the layers beyond the budgets go to --offload-folder",
        },
    )
    offload_folder: str | None = field(
        default=None,
        metadata={
            "metavar": "DIR",
            "help": "with --device-map: the folder for the layers placed on disk (read back as each layer runs)",
        },
    )
    load_in_4bit: bool = field(
        default=False,
        metadata={
            "help": "4-bit NF4 weights via bitsandbytes (pip install 'moee[quant]'): its nn.Linear layers "
            "only; fused 3-D expert weights stay in 16 bit (the log and every output say the share in 4 bit)"
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
    tokenizer: str | None = field(
        default=None,
        metadata={
            "metavar": "DIR_OR_ID",
            "help": "tokenizer directory or Hub id",
            "default_text": "the model's own; for a training checkpoint, the one its run was trained with",
        },
    )

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; expected one of: {', '.join(DTYPES)}")
        if self.device is not None and self.device_map is not None:
            raise ValueError("give either --device or --device-map, not both")
        # read once: a mapping of device -> bytes from here on (replace() reads it again, unchanged)
        object.__setattr__(self, "max_memory", parse_max_memory(self.max_memory))
        if self.offload_folder is not None:
            folder = os.fspath(self.offload_folder)
            if not folder or Path(folder).expanduser().is_file():
                raise ValueError(
                    f"--offload-folder {folder!r} is not a folder; give a directory to offload layers to"
                )
            object.__setattr__(self, "offload_folder", folder)
        for name, flag in (("max_memory", "--max-memory"), ("offload_folder", "--offload-folder")):
            if getattr(self, name) is not None and self.device_map is None:
                raise ValueError(
                    f"{flag} only applies with --device-map: add --device-map auto to let accelerate place "
                    "the layers within the memory budgets (and offload the rest to disk)"
                )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LoadOptions:
        """The options of ``moee.cli_options.add_loading_arguments``' flags, from parsed arguments."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

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
        """The keywords for ``from_pretrained`` besides the device: dtype, device_map with its memory
        budgets and offload folder, 4-bit config."""
        kwargs: dict[str, Any] = {}
        if self.dtype is not None:
            kwargs["dtype"] = self.torch_dtype()
        if self.device_map is not None:
            kwargs["device_map"] = self.device_map
        if self.max_memory is not None:
            kwargs["max_memory"] = dict(self.max_memory)  # accelerate rewrites the dict it is given
        if self.offload_folder is not None:
            kwargs["offload_folder"] = self.offload_folder
        if self.load_in_4bit:
            kwargs["quantization_config"] = four_bit_config()
        return kwargs


def four_bit_config() -> Any:
    """NF4 with double quantisation and bf16 compute (the official code's setting). bitsandbytes
    replaces ``nn.Linear`` layers only: a model whose experts are fused 3-D tensors (transformers 5
    MoE models) keeps them in 16 bit, which :func:`quantization_summary` measures."""
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


def quantization_summary(model: nn.Module) -> dict[str, Any]:
    """What a 4-bit load left in 4 bit: the parameters bitsandbytes holds in 4 bit (``Params4bit``,
    counted at their original size) against all of them, and the expert weights that kept their
    dtype (bitsandbytes replaces ``nn.Linear`` layers only; fused 3-D experts are not)."""
    import math

    try:
        from bitsandbytes.nn import Params4bit
    except ImportError:  # nothing can be in 4 bit
        Params4bit = ()  # noqa: N806
    total = four = experts = 0
    dtypes: set[str] = set()
    for name, param in model.named_parameters():
        if isinstance(param, Params4bit):
            shape = getattr(getattr(param, "quant_state", None), "shape", None)
            count = math.prod(shape) if shape is not None else 2 * param.numel()  # two per byte
            four += count
        else:
            count = param.numel()
            if "expert" in name.lower():
                experts += count
                dtypes.add(str(param.dtype).removeprefix("torch."))
        total += count
    return {
        "quantizer": "bitsandbytes-nf4",
        "params_total": total,
        "params_4bit": four,
        "share_4bit": round(four / total, 4) if total else 0.0,
        "expert_params_not_4bit": experts,
        "expert_dtype": ",".join(sorted(dtypes)) or None,
    }


def _report_quantization(name: str, model: nn.Module) -> None:
    """Say how much of ``model`` is in 4 bit (a warning when expert weights are not) and record it
    for every result this process writes (:func:`moee.provenance.note_quantization`)."""
    import logging
    import warnings

    from moee.provenance import note_quantization

    summary = quantization_summary(model)
    note_quantization(name, summary)
    total, experts = summary["params_total"], summary["expert_params_not_4bit"]
    message = f"--load-in-4bit: {summary['share_4bit']:.1%} of {name}'s {total:,} parameters are in 4 bit"
    if not experts:
        logging.getLogger(__name__).info(message)
        return
    warnings.warn(
        f"{message}; expert weights ({experts:,} params, {experts / total:.1%}) stay in "
        f"{summary['expert_dtype']}: bitsandbytes quantizes nn.Linear layers only, and this "
        "model's experts are fused 3-D weights",
        stacklevel=3,
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


def _not_found_on_hub(name: str, why: str) -> str:
    """The error of a model name that is neither a local directory nor loadable from the Hub."""
    return (
        f"model {name!r} is not a local directory, and {why}; check the name (a Hub id such as "
        f"org/name, or a model directory), or download it while online (huggingface-cli download {name})"
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


#: Files of which any one makes a directory hold a tokenizer ``AutoTokenizer`` can read.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "vocab.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)


def split_revision(spec: str | Path) -> tuple[str, str | None]:
    """``name@revision`` -> ``(name, revision)``; a local path (even one holding ``@``) or a name
    without ``@`` -> ``(spec, None)``."""
    text = str(spec)
    if Path(text).expanduser().exists() or "@" not in text:
        return text, None
    name, _, revision = text.rpartition("@")
    return name, revision or None


def _has_tokenizer(path: Path) -> bool:
    return any((path / name).is_file() for name in TOKENIZER_FILES)


class TokenizerSource(NamedTuple):
    """Where a model's tokenizer is read from: ``name`` (a directory or Hub id; ``None``: nowhere) and
    ``origin``: ``"option"`` (``LoadOptions.tokenizer``), ``"model"`` (the model's own), ``"run"``
    (the tokenizer a training checkpoint's run names) or ``"none"``."""

    name: str | None
    origin: str


def tokenizer_source(name_or_path: str | Path, options: LoadOptions | None = None) -> TokenizerSource:
    """Where the tokenizer of model ``name_or_path`` is read from: ``options.tokenizer`` when given;
    a Hub id's own; a local folder's own when it holds one (:data:`TOKENIZER_FILES`); else, for a
    training checkpoint, the tokenizer its run names (:func:`run_tokenizer`);
    else nowhere (``origin="none"``)."""
    if options is not None and options.tokenizer is not None:
        return TokenizerSource(options.tokenizer, "option")
    name, _ = split_revision(name_or_path)
    local = Path(name).expanduser()
    if not local.is_dir() or _has_tokenizer(local):
        return TokenizerSource(name, "model")  # a Hub id's tokenizer is resolved with the model
    named = run_tokenizer(local)
    return TokenizerSource(named, "run") if named is not None else TokenizerSource(None, "none")


def run_tokenizer(path: str | os.PathLike) -> str | None:
    """The tokenizer the run of checkpoint ``path`` was trained with (``trainer_state.json`` ->
    ``config.data.tokenizer``, as the run's config gave it), or ``None`` when ``path`` is no
    checkpoint or names none. Reads the state only (no hashes: nothing is resumed from it)."""
    state_path = Path(path) / CHECKPOINT_STATE_FILE
    if not state_path.is_file():
        return None
    try:
        state = json.loads(state_path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"checkpoint file {state_path} is corrupt: {exc}") from exc
    config = state.get("config") if isinstance(state, dict) else None
    data = config.get("data") if isinstance(config, dict) else None
    named = data.get("tokenizer") if isinstance(data, dict) else None
    return named if isinstance(named, str) and named else None


def _no_tokenizer(name: str) -> FileNotFoundError:
    return FileNotFoundError(
        f"no tokenizer for model {name}: the folder has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])} "
        "...) and is not a training checkpoint whose run names one; pass --tokenizer DIR "
        "(LoadOptions(tokenizer=...)) with the tokenizer the model was trained with"
    )


class Loaded(NamedTuple):
    """What :func:`load_model` returns: the model, its tokenizer (``None`` when not asked for) and
    where the tokenizer came from."""

    model: Any
    tokenizer: Any
    tokenizer_source: str | None


def load_model(
    name_or_path: str | Path,
    options: LoadOptions | None = None,
    *,
    tokenizer: bool = True,
    fallback_tokenizer: Any = None,
    **hf_kwargs: Any,
) -> Loaded:
    """Load model ``name_or_path`` (a local folder, a training checkpoint folder, a Hub id, or
    ``name@revision``) as ``options`` say, and its tokenizer (:func:`tokenizer_source`); the one loader
    of every command and of the Python API.

    Every moee model type is registered first, the weights come from :func:`load_causal_lm`
    (safetensors only unless ``options.allow_pickle_weights``), and without a ``device_map`` the model
    is moved to ``options.device`` (default: CUDA when available, else the CPU). ``hf_kwargs`` are
    further ``from_pretrained`` keywords (``attn_implementation`` ...). ``tokenizer=False`` loads the
    model only. ``fallback_tokenizer`` is used when the model has no tokenizer of its own and names
    none (checkpoints of one run share one); without it that is a ``FileNotFoundError`` that says
    what is missing and how to give it.
    """
    import torch

    from moee.models import register_models
    from moee.models.bundled import resolve_model

    register_models()
    name_or_path = resolve_model(name_or_path)  # a shipped model's name: its (assembled) folder
    options = options or LoadOptions()
    name, revision = split_revision(name_or_path)
    extra = {"revision": revision} if revision else {}
    source = tokenizer_source(name_or_path, options) if tokenizer else TokenizerSource(None, "none")
    missing = tokenizer and source.name is None and fallback_tokenizer is None
    if missing and (Path(name).expanduser() / "config.json").is_file():  # before reading the weights
        raise _no_tokenizer(name)
    try:
        model = load_causal_lm(
            name,
            trust_remote_code=options.trust_remote_code,
            allow_pickle_weights=options.allow_pickle_weights,
            **{**options.hf_kwargs(), **extra, **hf_kwargs},
        )
    except ValueError as exc:  # accelerate put layers on disk and there is no folder for them
        if "offload_folder" not in str(exc) or options.offload_folder is not None:
            raise
        raise ValueError(
            f"{name}: the device map puts some layers on disk (the memory budgets do not hold the whole "
            "model), and they need a folder: add --offload-folder DIR (LoadOptions(offload_folder=...)), "
            "or raise --max-memory"
        ) from exc
    except OSError as exc:  # a Hub name that cannot be fetched: said plainly, not a raw traceback
        if Path(name).expanduser().exists():
            raise
        from huggingface_hub import is_offline_mode

        why = (
            "the Hub is offline (HF_HUB_OFFLINE=1) and it is not in the local cache"
            if is_offline_mode()
            else f"it could not be loaded from the Hugging Face Hub ({str(exc).splitlines()[0]})"
        )
        raise FileNotFoundError(_not_found_on_hub(name, why)) from exc
    if options.load_in_4bit:
        _report_quantization(name, model)
    if "device_map" not in hf_kwargs and options.device_map is None:
        model.to(options.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if not tokenizer:
        return Loaded(model, None, None)
    if missing:
        raise _no_tokenizer(name)
    if source.name is None:
        return Loaded(model, fallback_tokenizer, None)
    from transformers import AutoTokenizer

    own = {"revision": revision} if revision and source.origin == "model" else {}
    try:
        tok = AutoTokenizer.from_pretrained(source.name, trust_remote_code=options.trust_remote_code, **own)
    except (OSError, ValueError) as exc:
        if source.origin != "run":
            raise
        raise FileNotFoundError(
            f"{name} is a training checkpoint whose run was trained with the tokenizer {source.name!r}, "
            f"which cannot be loaded from here ({type(exc).__name__}: {exc}); pass --tokenizer DIR "
            "(LoadOptions(tokenizer=...)) with that tokenizer"
        ) from exc
    return Loaded(model, tok, source.name)
