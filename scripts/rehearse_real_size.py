"""Rehearse moee on MoE checkpoints of real width: random weights, real configurations, real commands.

The models moee's users run (OLMoE-1B-7B, Qwen1.5-MoE-A2.7B, DeepSeekMoE-16B, gpt-oss-20b,
Qwen3-30B-A3B) cannot be downloaded here, but their configurations are public, and what breaks at
that size (a float32 copy of bfloat16 weights, an accumulator sized by the corpus, a load that holds
two copies) does not depend on the weights' values. Two steps:

``write NAME --out DIR [--layers N] [--tiny]``
    writes a checkpoint folder the way the Hub stores one: ``config.json`` of the named
    configuration (:data:`CONFIGS`, transcribed from each model's published ``config.json``; the
    parameter count at full depth is checked against the published one), seeded random bfloat16
    weights with the model's own initialisation (``_init_weights``: normal with the config's
    ``initializer_range``, 0.02; norms at one), in the checkpoint's own tensor names (transformers'
    ``revert_weight_conversion``: per-expert tensors where the Hub has them), as safetensors shards
    of at most ``--shard-size`` with a ``model.safetensors.index.json``. The model is built on the
    ``meta`` device; one part at a time (the embedding, one decoder layer, the head) is made real,
    initialised, written straight into its shard and freed, so the writer holds one layer, never a
    shard or the model. ``--layers N`` keeps the first N decoder layers where the whole model does
    not fit on disk; ``--tiny`` shrinks the widths (hidden 64, 8 experts top-2) and keeps the
    structure, for tests. The tokenizer is the bundled model's (24,331 ids: every configuration's
    vocabulary covers it), with ``--max-length`` as its model length.
``run DIR``
    runs moee on such a folder, every command in its own process with ``--dtype bfloat16``:
    ``embed`` (``--texts`` texts), ``evaluate --tasks lee_sts``, ``report`` on corpora of
    ``--report-tokens`` tokens (texts of 64-192 tokens: memory must not grow with the corpus),
    ``routes``, ``ablate`` of a few experts, ``serve`` queried with the ``openai`` client, and the
    oracle check
    (``moee.capture.oracle.check_model``: the hooks' routing distributions against the model's own
    ``output_router_logits``, in bfloat16, tolerance :data:`ORACLE_ATOL`). For each it records the
    load time and memory, and writes ``bench/results/rehearsal/<folder name>.json``. ``--delete``
    removes the checkpoint afterwards.

Memory is the peak **anonymous** resident memory (``RssAnon`` of ``/proc/PID/status``), sampled
every 10 ms by this process while the command runs: the process' own allocations (weights copied
into tensors, activations, accumulators). ``VmHWM`` (the kernel's high-water mark of the whole
resident set) is recorded too, but it also counts file pages: safetensors are memory-mapped, and
the mapped checkpoint pages a load touches are resident without being the process' allocation (the
kernel drops them under pressure), so ``VmHWM`` can read up to twice the weights for a load that
never holds two copies. The sampled peak can miss a spike shorter than the interval; the load's own
figures (before and after ``load_model``) are read inside the process.

    python scripts/rehearse_real_size.py write olmoe-1b-7b --layers 2 --out build/rehearsal/olmoe-L2
    python scripts/rehearse_real_size.py run build/rehearsal/olmoe-L2 --texts 200 --delete
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "rehearsal"
#: The checkpoint folder's own record: which configuration, how deep, how many bytes of weights.
MANIFEST = "rehearsal.json"
#: Largest absolute difference allowed between a routing distribution the hooks pooled and the one
#: computed from ``output_router_logits``: both read the same bfloat16 router output, so only the
#: float32 pooling order differs (the tiny float32 check allows 1e-5).
ORACLE_ATOL = 1e-4
#: The dispatch weights over the native scores may spread by this much relatively: the block
#: rounds its weights to bfloat16 (8 bits of mantissa) before the experts use them.
ORACLE_SPREAD = 2**-6

#: Each configuration as its model's published ``config.json`` states it (transformers field
#: names), its Hub id and published parameter count (checked at full depth by the tests).
CONFIGS: dict[str, dict[str, Any]] = {
    "olmoe-1b-7b": {
        "hub_id": "allenai/OLMoE-1B-7B-0924",
        "params": 6.92e9,
        "config": {
            "model_type": "olmoe",
            "vocab_size": 50304,
            "hidden_size": 2048,
            "intermediate_size": 1024,
            "num_hidden_layers": 16,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "num_experts": 64,
            "num_experts_per_tok": 8,
            "norm_topk_prob": False,
            "clip_qkv": None,
            "max_position_embeddings": 4096,
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-5,
            "router_aux_loss_coef": 0.01,
            "tie_word_embeddings": False,
        },
    },
    "qwen1.5-moe-a2.7b": {
        "hub_id": "Qwen/Qwen1.5-MoE-A2.7B",
        "params": 14.3e9,
        "config": {
            "model_type": "qwen2_moe",
            "vocab_size": 151936,
            "hidden_size": 2048,
            "intermediate_size": 5632,
            "moe_intermediate_size": 1408,
            "shared_expert_intermediate_size": 5632,
            "num_hidden_layers": 24,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "num_experts": 60,
            "num_experts_per_tok": 4,
            "norm_topk_prob": False,
            "decoder_sparse_step": 1,
            "max_position_embeddings": 8192,
            "max_window_layers": 21,
            "use_sliding_window": False,
            "sliding_window": 32768,
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6,
            "router_aux_loss_coef": 0.001,
            "tie_word_embeddings": False,
        },
    },
    "deepseek-moe-16b": {
        "hub_id": "deepseek-ai/deepseek-moe-16b-base",
        "params": 16.4e9,
        "config": {
            "model_type": "deepseek",  # moee.models.deepseek_v1
            "vocab_size": 102400,
            "hidden_size": 2048,
            "intermediate_size": 10944,
            "moe_intermediate_size": 1408,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "n_routed_experts": 64,
            "n_shared_experts": 2,
            "num_experts_per_tok": 6,
            "first_k_dense_replace": 1,
            "moe_layer_freq": 1,
            "norm_topk_prob": False,
            "scoring_func": "softmax",
            "max_position_embeddings": 4096,
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
        },
    },
    "gpt-oss-20b": {
        "hub_id": "openai/gpt-oss-20b",
        "params": 20.9e9,  # the Hub's experts are MXFP4; here every weight is bfloat16
        "config": {
            "model_type": "gpt_oss",
            "vocab_size": 201088,
            "hidden_size": 2880,
            "intermediate_size": 2880,
            "num_hidden_layers": 24,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "num_local_experts": 32,
            "num_experts_per_tok": 4,
            "sliding_window": 128,
            "layer_types": ["sliding_attention", "full_attention"] * 12,
            "max_position_embeddings": 131072,
            "rope_theta": 150000.0,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "original_max_position_embeddings": 4096,
                "truncate": False,
            },
            "rms_norm_eps": 1e-5,
            "swiglu_limit": 7.0,
            "attention_bias": True,
            "router_aux_loss_coef": 0.9,
            "tie_word_embeddings": False,
        },
    },
    "qwen3-30b-a3b": {
        "hub_id": "Qwen/Qwen3-30B-A3B",
        "params": 30.5e9,
        "config": {
            "model_type": "qwen3_moe",
            "vocab_size": 151936,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "moe_intermediate_size": 768,
            "num_hidden_layers": 48,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "max_position_embeddings": 40960,
            "max_window_layers": 48,
            "use_sliding_window": False,
            "sliding_window": None,
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6,
            "attention_bias": False,
            "router_aux_loss_coef": 0.001,
            "tie_word_embeddings": False,
        },
    },
}

#: ``--tiny``: the widths of a test-sized model of the same structure.
_TINY_WIDTHS = {
    "hidden_size": 64,
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "num_attention_heads": 4,
    "head_dim": 16,
    "num_experts": 8,
    "num_local_experts": 8,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
}
_SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


# ----------------------------------------------------------------------------- the configuration
def build_config(name: str, *, layers: int | None = None, tiny: bool = False) -> Any:
    """The transformers config of configuration ``name``, with its first ``layers`` decoder layers
    (default: all; with ``tiny``, the dense ones plus two) and, with ``tiny``, test widths."""
    from transformers import AutoConfig

    from moee.models import register_models

    if name not in CONFIGS:
        raise SystemExit(f"unknown configuration {name!r}; choose one of: {', '.join(CONFIGS)}")
    register_models()  # model_type "deepseek"
    fields = dict(CONFIGS[name]["config"])
    model_type = fields.pop("model_type")
    dense = int(fields.get("first_k_dense_replace", 0))
    if tiny:
        heads = fields["num_attention_heads"]
        for key, value in _TINY_WIDTHS.items():
            if key in fields:
                fields[key] = value
        fields["num_key_value_heads"] = 4 if fields.get("num_key_value_heads") == heads else 2
    full = fields["num_hidden_layers"]
    depth = layers if layers is not None else (dense + 2 if tiny else full)
    if not dense < depth <= full:
        raise SystemExit(f"--layers must be in {dense + 1}..{full} for {name} (its first {dense} are dense)")
    fields["num_hidden_layers"] = depth
    if "layer_types" in fields:
        fields["layer_types"] = fields["layer_types"][:depth]
    if "max_window_layers" in fields:
        fields["max_window_layers"] = min(fields["max_window_layers"], depth)
    config = AutoConfig.for_model(model_type, **fields)
    config.dtype = "bfloat16"
    return config


def meta_model(config: Any) -> Any:
    """The model of ``config`` on the ``meta`` device (shapes, names and init code, no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    if getattr(config, "tie_word_embeddings", False):
        raise ValueError("tied embeddings are not written by this script (no configuration here has them)")
    return model


# ----------------------------------------------------------------------------- the weights
def model_parts(model: Any) -> list[tuple[str, Any]]:
    """``(prefix, module)`` of the pieces written one at a time, in checkpoint order: each child of
    the base model (each decoder layer by itself), then the head; only pieces with saved tensors."""
    from torch import nn

    base_name = model.base_model_prefix
    base = getattr(model, base_name)
    parts: list[tuple[str, Any]] = []
    for name, child in base.named_children():
        if isinstance(child, nn.ModuleList):
            parts += [(f"{base_name}.{name}.{i}", layer) for i, layer in enumerate(child)]
        else:
            parts.append((f"{base_name}.{name}", child))
    parts += [(name, child) for name, child in model.named_children() if child is not base]
    parts = [(prefix, module) for prefix, module in parts if module.state_dict()]
    written = [f"{prefix}.{key}" for prefix, module in parts for key in module.state_dict()]
    expected = list(model.state_dict())
    if sorted(written) != sorted(expected) or len(set(written)) != len(written):
        raise AssertionError(f"the parts do not cover the model once: {sorted(set(written) ^ set(expected))}")
    return parts


def part_state(model: Any, index: int, prefix: str, module: Any, seed: int) -> dict[str, Any]:
    """Part ``index`` made real and initialised by the model's own ``_init_weights`` (seeded by
    ``seed`` and the part's index, so a part's values do not depend on the others), in the model's
    tensor names. Every tensor starts as NaN: one the init code leaves alone is an error."""
    import torch

    module.to_empty(device="cpu")
    with torch.no_grad():
        for tensor in module.state_dict().values():
            if tensor.is_floating_point():
                tensor.fill_(float("nan"))
        torch.manual_seed(seed * 1_000_003 + index)
        for sub in module.modules():
            model._init_weights(sub)
    state = {f"{prefix}.{key}": tensor for key, tensor in module.state_dict().items()}
    left = [name for name, tensor in state.items() if tensor.is_floating_point() and tensor.isnan().any()]
    if left:
        raise AssertionError(f"the model's init code left these tensors uninitialised: {left}")
    return state


def release(module: Any) -> None:
    """Back to ``meta``: the part's memory is freed, and handed back to the system. A part of
    per-expert tensors (DeepSeekMoE: 64 x 3 of 5.8 MB per layer) is allocated from glibc's heap
    once the first free has raised its mmap threshold, and the freed heap is not returned while
    later allocations sit above it: without the trim the writer kept every such layer resident
    (24 GB after 11 of DeepSeekMoE-16B's 28 layers)."""
    module.to_empty(device="meta")
    _trim_heap()


def _trim_heap() -> None:
    """``malloc_trim(0)`` where the C library is glibc (elsewhere nothing to do)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def model_state(config: Any, seed: int = 0) -> dict[str, Any]:
    """The whole state :func:`write_checkpoint` writes, in the model's names, built in memory (tests:
    a model loaded with it is the reference the written folder must equal)."""
    model = meta_model(config)
    state: dict[str, Any] = {}
    for index, (prefix, module) in enumerate(model_parts(model)):
        state.update({k: v.clone() for k, v in part_state(model, index, prefix, module, seed).items()})
        release(module)
    return state


def _to_checkpoint_names(model: Any, state: dict[str, Any]) -> dict[str, Any]:
    """The tensors as the Hub checkpoint stores them (per-expert weights where it has them)."""
    from transformers.core_model_loading import revert_weight_conversion

    return {k: v.contiguous() for k, v in revert_weight_conversion(model, dict(state)).items()}


@dataclass
class _Planned:
    name: str
    dtype: str
    shape: list[int]
    nbytes: int
    shard: int


def _plan(model: Any, parts: list[tuple[str, Any]], shard_bytes: int) -> list[list[_Planned]]:
    """Every checkpoint tensor, per part, with its shard: shapes come from the ``meta`` model, so
    each shard's header is known before its first byte is written."""
    plan: list[list[_Planned]] = []
    shard, used = 0, 0
    for prefix, module in parts:
        state = {f"{prefix}.{k}": v for k, v in module.state_dict().items()}
        entries = []
        for name, tensor in sorted(_to_checkpoint_names(model, state).items()):
            dtype = str(tensor.dtype).removeprefix("torch.")
            nbytes = tensor.numel() * tensor.element_size()
            if used and used + nbytes > shard_bytes:
                shard, used = shard + 1, 0
            used += nbytes
            entries.append(_Planned(name, _SAFETENSORS_DTYPES[dtype], list(tensor.shape), nbytes, shard))
        plan.append(entries)
    return plan


class _ShardFile:
    """One safetensors file written front to back: header (from the plan), then each tensor's bytes."""

    def __init__(self, path: Path, entries: list[_Planned]) -> None:
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for entry in entries:
            header[entry.name] = {
                "dtype": entry.dtype,
                "shape": entry.shape,
                "data_offsets": [offset, offset + entry.nbytes],
            }
            offset += entry.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self.expected = [entry.name for entry in entries]
        self.path = path
        self.handle = open(path, "wb")  # noqa: SIM115 - closed by close()
        self.handle.write(struct.pack("<Q", len(text)) + text)

    def write(self, name: str, tensor: Any) -> None:
        import torch

        if not self.expected or self.expected[0] != name:
            raise AssertionError(f"{self.path.name}: wrote {name}, the plan has {self.expected[:1]}")
        self.expected.pop(0)
        self.handle.write(tensor.reshape(-1).view(torch.uint8).numpy().data)

    def close(self) -> None:
        self.handle.close()
        if self.expected:
            raise AssertionError(f"{self.path.name}: {len(self.expected)} planned tensors were not written")


def write_checkpoint(
    name: str,
    out: Path,
    *,
    layers: int | None = None,
    tiny: bool = False,
    seed: int = 0,
    shard_bytes: int = 2 * 10**9,
    max_length: int = 512,
    command: str | None = None,
) -> dict[str, Any]:
    """Write configuration ``name`` to the folder ``out`` (see the module docstring); returns the
    manifest it also writes there (:data:`MANIFEST`)."""
    from transformers import AutoTokenizer

    from moee.embed.embedder import MINILM_MOE_DIR

    config = build_config(name, layers=layers, tiny=tiny)
    tokenizer = AutoTokenizer.from_pretrained(MINILM_MOE_DIR)
    if len(tokenizer) > config.vocab_size:
        raise ValueError(
            f"the tokenizer's {len(tokenizer)} ids do not fit {name}'s vocabulary of {config.vocab_size}"
        )
    # the bundled tokenizer's special ids (the real checkpoints' ids would name tokens it lacks),
    # before the weights: the init zeroes the padding id's embedding row
    config.pad_token_id, config.bos_token_id = tokenizer.pad_token_id, tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    out.mkdir(parents=True, exist_ok=False)
    model = meta_model(config)
    parts = model_parts(model)
    plan = _plan(model, parts, shard_bytes)
    n_shards = max(entry.shard for entries in plan for entry in entries) + 1
    files = [f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors" for i in range(n_shards)]
    by_shard: dict[int, list[_Planned]] = {}
    for entry in (e for entries in plan for e in entries):
        by_shard.setdefault(entry.shard, []).append(entry)
    start = time.perf_counter()
    current: _ShardFile | None = None
    for index, ((prefix, module), entries) in enumerate(zip(parts, plan, strict=True)):
        tensors = _to_checkpoint_names(model, part_state(model, index, prefix, module, seed))
        for entry in entries:
            if current is None or current.path.name != files[entry.shard]:
                if current is not None:
                    current.close()
                current = _ShardFile(out / files[entry.shard], by_shard[entry.shard])
            current.write(entry.name, tensors[entry.name])
        del tensors
        release(module)
    assert current is not None
    current.close()
    weight_map = {e.name: files[e.shard] for entries in plan for e in entries}
    total = sum(e.nbytes for entries in plan for e in entries)
    full = CONFIGS[name]["config"]["num_hidden_layers"]
    n_params = sum(p.numel() for p in model.parameters())
    index_doc = {"metadata": {"total_size": total, "total_parameters": n_params}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index_doc, indent=2, sort_keys=True) + "\n")
    config.architectures = [type(model).__name__]
    config.save_pretrained(out)
    tokenizer.model_max_length = max_length
    tokenizer.save_pretrained(out)
    manifest = {
        "configuration": name,
        "hub_id": CONFIGS[name]["hub_id"],
        "model_type": config.model_type,
        "layers": config.num_hidden_layers,
        "full_layers": full,
        "tiny": tiny,
        "seed": seed,
        "dtype": "bfloat16",
        "parameters": n_params,
        "full_parameters": sum(
            p.numel() for p in meta_model(build_config(name, tiny=tiny, layers=full)).parameters()
        ),
        "weight_bytes": total,
        "shards": n_shards,
        "shard_bytes": shard_bytes,
        "tokenizer": "moee/assets/default-model (the bundled model's)",
        "max_length": max_length,
        "write_s": round(time.perf_counter() - start, 1),
        # the writer's own peak resident memory: one part at a time, never the whole model
        "write_vm_hwm_bytes": _proc_status().get("VmHWM"),
        "command": command,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


# ----------------------------------------------------------------------------- measuring a command
def _proc_status(pid: int | str = "self") -> dict[str, int]:
    """The memory lines of ``/proc/PID/status``, in bytes (empty once the process is gone)."""
    keys = ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem")
    try:
        with open(f"/proc/{pid}/status") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        key, _, value = line.partition(":")
        if key in keys:
            out[key] = int(value.split()[0]) * 1024
    return out


def mapped_weight_bytes(model: Any) -> int:
    """Bytes of ``model``'s CPU tensors whose memory is a mapping of a ``.safetensors`` file: a
    bfloat16 weight loaded as bfloat16 with no conversion can stay a view of the memory-mapped
    checkpoint. Those pages are resident while the model runs but are file pages, not ``RssAnon``,
    so they are added to it to count what the model holds."""
    ranges = []
    with open("/proc/self/maps") as fh:
        for line in fh:
            fields = line.split()
            if len(fields) >= 6 and fields[5].endswith(".safetensors"):
                low, high = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((low, high))
    seen, total = set(), 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.device.type != "cpu":
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        if any(low <= storage.data_ptr() < high for low, high in ranges):
            total += storage.nbytes()
    return total


class _Sampler(threading.Thread):
    """Polls ``/proc/PID/status`` every ``interval`` seconds; keeps the peak of each figure
    (``reset`` starts a new peak, e.g. at the start of a load)."""

    def __init__(self, pid: int | str, interval: float = 0.01) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.peak: dict[str, int] = {}
        self.samples = 0
        self.stopped = threading.Event()

    def reset(self) -> None:
        self.peak = dict(_proc_status(self.pid))

    def run(self) -> None:
        while not self.stopped.is_set():
            status = _proc_status(self.pid)
            if not status:
                break
            self.samples += 1
            for key, value in status.items():
                self.peak[key] = max(self.peak.get(key, 0), value)
            time.sleep(self.interval)


def _instrument(marker: Path) -> None:
    """Inside a measured process: time every ``moee.loading.load_model`` call and note the memory
    before, during (sampled peak) and after it, the weights left mapped from the checkpoint
    (:func:`mapped_weight_bytes`), and at exit the memory and its peak since the (last) load, in
    ``marker`` (JSON, rewritten at each event)."""
    import atexit

    import moee.loading as loading

    events: dict[str, Any] = {"loads": []}
    sampler = _Sampler("self")
    sampler.start()

    def save() -> None:
        marker.write_text(json.dumps(events))

    original = loading.load_model

    def timed(*args: Any, **kwargs: Any) -> Any:
        before = _proc_status()
        sampler.reset()
        start = time.perf_counter()
        loaded = original(*args, **kwargs)
        seconds = time.perf_counter() - start
        events["loads"].append(
            {
                "seconds": seconds,
                "before": before,
                "peak": dict(sampler.peak),
                "after": _proc_status(),
                "mapped_weight_bytes": mapped_weight_bytes(loaded.model),
            }
        )
        save()
        sampler.reset()  # from here on: the run's own peak (at exit)
        return loaded

    loading.load_model = timed

    def at_exit() -> None:
        events["exit"] = _proc_status()
        events["run_peak"] = dict(sampler.peak)
        save()

    atexit.register(at_exit)


def _measured(args: list[str], marker: Path) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "_measure", str(marker), "--", *args]


def _summary(
    name: str, sampler: _Sampler, marker: Path, wall: float, rc: int, weight_bytes: int
) -> dict[str, Any]:
    """One step's figures. ``held``: ``RssAnon`` plus the weights still mapped from the checkpoint
    (:func:`mapped_weight_bytes`); ``*_over_weights``: divided by the checkpoint's bytes;
    ``run_growth``: the peak after the load over the memory right after it (activations,
    accumulators, caches); ``load_peak``: the peak during the load."""
    events = json.loads(marker.read_text()) if marker.is_file() else {}
    loads = events.get("loads", [])
    peak = sampler.peak.get("RssAnon", 0)
    result: dict[str, Any] = {
        "step": name,
        "returncode": rc,
        "wall_s": round(wall, 2),
        "peak_rss_anon_bytes": peak,
        "peak_vm_rss_bytes": sampler.peak.get("VmRSS", 0),
        "vm_hwm_bytes": (events.get("exit") or {}).get("VmHWM") or sampler.peak.get("VmHWM", 0),
        "samples": sampler.samples,
    }
    if loads:
        first = loads[0]
        before, after = first["before"].get("RssAnon", 0), first["after"].get("RssAnon", 0)
        load_peak, mapped = first["peak"].get("RssAnon", 0), first["mapped_weight_bytes"]
        result.update(
            loads=len(loads),
            load_s=round(sum(x["seconds"] for x in loads), 2),
            rss_anon_before_load_bytes=before,
            load_peak_rss_anon_bytes=load_peak,
            rss_anon_after_load_bytes=after,
            mapped_weight_bytes=mapped,
            held_after_load_over_weights=round((after - before + mapped) / weight_bytes, 3),
            load_peak_over_weights=round((load_peak - before + mapped) / weight_bytes, 3),
            run_growth_bytes=(events.get("run_peak") or {}).get("RssAnon", peak) - after,
            peak_held_bytes=peak + mapped,
            peak_held_over_weights=round((peak + mapped) / weight_bytes, 3),
        )
    return result


def run_measured(
    name: str, moee_args: list[str], work: Path, weight_bytes: int, *, timeout: float
) -> dict[str, Any]:
    """Run ``moee <moee_args>`` in its own process, sampled; its summary (:func:`_summary`)."""
    marker = work / f"{name}.marker.json"
    log = work / f"{name}.log"
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            _measured(moee_args, marker), stdout=out, stderr=subprocess.STDOUT, env=_env()
        )
        sampler = _Sampler(proc.pid)
        sampler.start()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    sampler.stopped.set()
    sampler.join()
    result = _summary(name, sampler, marker, time.perf_counter() - start, rc, weight_bytes)
    result["command"] = "moee " + shlex.join(moee_args)
    if rc != 0:
        result["log_tail"] = log.read_text(errors="replace")[-3000:]
    print(f"{name}: rc={rc} {result['wall_s']} s, peak RssAnon {peak_gb(result)}", flush=True)
    return result


def peak_gb(result: dict[str, Any]) -> str:
    """The peak for the progress line: GB of ``RssAnon`` and the held memory over the weights."""
    return f"{result['peak_rss_anon_bytes'] / 1e9:.2f} GB (held {result.get('peak_held_over_weights')}x the weights)"


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


# ----------------------------------------------------------------------------- the steps
#: Token counts of the report corpora's texts: one band, so every corpus size meets batches of the
#: same shapes and the comparison of sizes measures what the report keeps, not a longer batch.
REPORT_TEXT_TOKENS = (64, 192)


def corpus_of_tokens(tokenizer: Any, tokens: int, seed: int = 0) -> list[str]:
    """Texts of the length mix (``moee.benchmarking.length_mix_texts``) of
    :data:`REPORT_TEXT_TOKENS` tokens each, until they hold ``tokens`` tokens."""
    from moee.benchmarking import length_mix_texts

    low, high = REPORT_TEXT_TOKENS
    texts, count = [], 0
    for text in length_mix_texts(20_000, seed=seed):
        if count >= tokens:
            return texts
        n = len(tokenizer(text, verbose=False)["input_ids"])
        if low <= n <= high:
            texts.append(text.replace("\n", " "))
            count += n
    raise ValueError(f"the length mix holds fewer than {tokens} tokens in texts of {low}-{high} tokens")


def _write_lines(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(t.replace("\n", " ") + "\n" for t in texts), encoding="utf-8")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_step(
    model_args: list[str], texts: list[str], work: Path, weight_bytes: int, *, timeout: float, batch: int = 8
) -> dict[str, Any]:
    """``moee serve`` sampled like the other steps, queried with the ``openai`` client: every text
    embedded in requests of ``batch`` inputs; stopped with SIGTERM (a clean drain)."""
    import numpy as np
    from openai import OpenAI

    port = _free_port()
    marker, log = work / "serve.marker.json", work / "serve.log"
    args = ["serve", *model_args, "--port", str(port)]
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(_measured(args, marker), stdout=out, stderr=subprocess.STDOUT, env=_env())
        sampler = _Sampler(proc.pid)
        sampler.start()
        url = f"http://127.0.0.1:{port}"
        vectors, query_s, error = [], None, None
        try:
            while True:  # until the model is loaded and the server answers
                if proc.poll() is not None:
                    raise RuntimeError(f"moee serve exited with {proc.returncode}")
                if time.perf_counter() - start > timeout:
                    raise TimeoutError("moee serve did not answer /health in time")
                with contextlib.suppress(OSError):
                    with urllib.request.urlopen(url + "/health", timeout=2) as response:
                        if response.status == 200:
                            break
                time.sleep(0.5)
            ready_s = time.perf_counter() - start
            client = OpenAI(base_url=url + "/v1", api_key="unused", timeout=timeout, max_retries=0)
            model_id = client.models.list().data[0].id
            t0 = time.perf_counter()
            for i in range(0, len(texts), batch):
                response = client.embeddings.create(model=model_id, input=texts[i : i + batch])
                vectors += [row.embedding for row in response.data]
            query_s = time.perf_counter() - t0
        except Exception as exc:  # recorded in the result; the server is stopped either way
            error, ready_s = f"{type(exc).__name__}: {exc}", None
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                rc = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
    sampler.stopped.set()
    sampler.join()
    result = _summary("serve", sampler, marker, time.perf_counter() - start, rc, weight_bytes)
    result.update(
        command="moee " + shlex.join(args),
        ready_s=None if ready_s is None else round(ready_s, 2),
        texts=len(vectors),
        requests=math.ceil(len(texts) / batch),
        query_s=None if query_s is None else round(query_s, 2),
        dim=len(vectors[0]) if vectors else None,
    )
    if error is not None or len(vectors) != len(texts):
        result["error"] = error or f"{len(vectors)} vectors for {len(texts)} texts"
        result["log_tail"] = log.read_text(errors="replace")[-3000:]
    else:
        result["vectors_finite"] = bool(np.isfinite(np.asarray(vectors)).all())
        embedded = work / "embed.npy"
        if embedded.is_file():  # the same texts through `moee embed` (other batches: bf16 differs a little)
            result["max_abs_diff_vs_embed"] = float(
                np.abs(np.load(embedded)[: len(vectors)] - np.asarray(vectors)).max()
            )
    print(f"serve: rc={rc} {result['wall_s']} s, peak RssAnon {peak_gb(result)}", flush=True)
    return result


def _bf16_options(prog: str, load_flags: Sequence[str]) -> Any:
    """The ``LoadOptions`` a measured in-process step loads with: bfloat16 plus the run's loading flags,
    read by the commands' own flag parser (on the CPU unless the flags place the model)."""
    from moee.cli_options import add_loading_arguments, load_options

    parser = argparse.ArgumentParser(prog=prog)
    add_loading_arguments(parser, model=False)
    placed = [] if "--device-map" in load_flags else ["--device", "cpu"]
    return load_options(parser.parse_args(["--dtype", "bfloat16", *placed, *load_flags]))


def oracle_main(folder: str, out: str, load_flags: Sequence[str] = ()) -> int:
    """The oracle check on the checkpoint in bfloat16 (run in a measured process by ``run``), loaded
    with the other steps' loading flags (``load_flags``: a model larger than memory is checked
    under the same memory cap and disk offload)."""
    from dataclasses import asdict

    from moee.capture.oracle import check_model
    from moee.loading import load_model

    model = load_model(folder, _bf16_options("_oracle", load_flags), tokenizer=False).model.eval()
    try:
        result: dict[str, Any] = {
            "passed": True,
            **asdict(check_model(model, atol=ORACLE_ATOL, spread_tol=ORACLE_SPREAD)),
        }
    except AssertionError as exc:
        result = {"passed": False, "error": str(exc)}
    offloaded = sum(p.numel() for p in model.parameters() if p.device.type == "meta")
    result.update(
        atol=ORACLE_ATOL,
        spread_tol=ORACLE_SPREAD,
        dtype=str(next(model.parameters()).dtype),
        offloaded_parameters=offloaded,  # held on disk between uses (accelerate's offload)
    )
    Path(out).write_text(json.dumps(result, indent=2))
    return 0 if result["passed"] else 1


def capture_main(folder: str, out: str, texts: int, repeats: int, load_flags: Sequence[str] = ()) -> int:
    """Capture overhead at the checkpoint's real widths in bfloat16: ``encode(method="rw")`` against a
    plain backbone forward of the very batches encode builds, interleaved (``repeats`` pairs after a
    warm-up), loaded with the run's loading flags; the paired median ratio goes to ``out``."""
    import statistics

    import torch

    from moee.benchmarking import capture_overhead_variants, length_mix_texts, paired_ratio, time_interleaved
    from moee.embed.embedder import MoEEmbedder

    embedder = MoEEmbedder.from_pretrained(folder, _bf16_options("_capture", load_flags))
    sample = [t.replace("\n", " ") for t in length_mix_texts(texts, seed=3)]
    wall, cpu = time.perf_counter(), time.process_time()
    times = time_interleaved(capture_overhead_variants(embedder, sample, batch_size=8), repeats=repeats)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    result = {
        "goal": f"<= {CAPTURE_GOAL}",
        "texts": len(sample),
        "tokens": sum(len(s) for s in embedder._tokenize(sample)),
        "repeats": repeats,
        "median_ratio_encode_rw_vs_plain": paired_ratio(times["encode_rw"], times["plain_forward"]),
        "median_s": {k: statistics.median(v) for k, v in times.items()},
        "dtype": str(next(embedder.model.parameters()).dtype),
        "load_average_1m": os.getloadavg()[0],  # other jobs share the cores: the ratio is paired
        "torch_threads": torch.get_num_threads(),
        # the share of its threads' time the timing got: near 1 means no other job took its cores,
        # whatever the load average says of the machine as a whole
        "cpu_share": cpu / (wall * torch.get_num_threads()),
    }
    Path(out).write_text(json.dumps(result, indent=2))
    return 0


#: The capture overhead goal at real widths (encode(rw) over a plain forward of the same batches).
CAPTURE_GOAL = 1.02


def run_rehearsal(args: argparse.Namespace) -> dict[str, Any]:
    """Every step of ``run`` on the folder ``args.folder``; the result document."""
    from transformers import AutoTokenizer

    from moee.benchmarking import length_mix_texts

    folder = Path(args.folder).resolve()
    manifest = json.loads((folder / MANIFEST).read_text())
    weight_bytes = int(manifest["weight_bytes"])
    work = Path(args.work or folder.parent / f"{folder.name}-runs").resolve()
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    texts = [t.replace("\n", " ") for t in length_mix_texts(args.texts, seed=1)]
    corpus = _write_lines(work / "texts.txt", texts)
    model = ["--model", str(folder), "--dtype", "bfloat16", *shlex.split(args.load_flags or "")]
    batch = ["--batch-size", str(args.batch_size)]
    steps = set(args.steps.split(","))
    results: list[dict[str, Any]] = []

    def measure(name: str, moee_args: list[str]) -> None:
        if name.split("-")[0] in steps:
            results.append(run_measured(name, moee_args, work, weight_bytes, timeout=args.timeout))

    measure(
        "embed", ["embed", str(corpus), *model, *batch, "--out", str(work / "embed.npy"), "--no-progress"]
    )
    measure("evaluate", ["evaluate", *model, *batch, "--tasks", "lee_sts", "--methods", "moee_sum",
                         "--prompts", "none", "--out", str(work / "eval")])  # fmt: skip
    for tokens in args.report_tokens:
        texts_n = corpus_of_tokens(tokenizer, tokens, seed=2)
        report_corpus = _write_lines(work / f"report-{tokens}.txt", texts_n)
        measure(f"report-{tokens}", ["report", *model, *batch, "--corpus", str(report_corpus),
                                     "--permutations", "2", "--out", str(work / f"report-{tokens}")])  # fmt: skip
        if "report" in steps:
            results[-1].update(corpus_tokens=tokens, corpus_texts=len(texts_n))
    measure(
        "routes", ["routes", *model, *batch, "--corpus", str(corpus), "--out", str(work / "routes.parquet")]
    )
    measure("ablate", ["ablate", *model, *batch, "--corpus", str(corpus), "--experts", "0:0", "0:1", "0:2",
                       "--max-tokens", str(args.ablate_tokens), "--no-null", "--out", str(work / "ablate")])  # fmt: skip
    if "serve" in steps:
        results.append(serve_step(model, texts, work, weight_bytes, timeout=args.timeout))
    if "capture" in steps:
        out = work / "capture.json"
        step = run_measured(
            "capture",
            [
                "_capture",
                str(folder),
                str(out),
                str(min(len(texts), 32)),
                str(args.capture_repeats),
                *shlex.split(args.load_flags or ""),
            ],
            work,
            weight_bytes,
            timeout=args.timeout,
        )
        step["command"] = (
            f"encode(method='rw') vs a plain forward of the same batches, {args.capture_repeats} interleaved pairs"
        )
        step["overhead"] = json.loads(out.read_text()) if out.is_file() else None
        results.append(step)
    if "oracle" in steps:
        out = work / "oracle.json"
        step = run_measured(
            "oracle",
            ["_oracle", str(folder), str(out), *shlex.split(args.load_flags or "")],
            work,
            weight_bytes,
            timeout=args.timeout,
        )
        flags = f", {args.load_flags}" if args.load_flags else ""
        step["command"] = f"moee.capture.oracle.check_model(load_model({folder.name}, dtype=bfloat16{flags}))"
        step["check"] = json.loads(out.read_text()) if out.is_file() else None
        results.append(step)
    document = {"checkpoint": manifest, "texts": len(texts), "batch_size": args.batch_size, "steps": results}
    if args.delete:
        shutil.rmtree(folder)
        shutil.rmtree(work)
        document["deleted"] = True
    return document


def rerun_into(result: Path, document: dict[str, Any]) -> dict[str, Any]:
    """``document``'s steps put in place of the same steps of the earlier ``result`` (which must
    exist and be of the same checkpoint); the earlier run's record stays, each rerun is listed."""
    if not result.is_file():
        raise SystemExit(f"--rerun: there is no earlier result {result}")
    earlier = json.loads(result.read_text())
    keep = ("configuration", "layers", "seed", "weight_bytes")
    if {k: earlier["checkpoint"].get(k) for k in keep} != {k: document["checkpoint"].get(k) for k in keep}:
        raise SystemExit(f"--rerun: {result} is a result of another checkpoint")
    new = {s["step"]: s for s in document["steps"]}
    steps = [new.pop(s["step"], s) for s in earlier["steps"]] + list(new.values())
    from moee.provenance import run_record, utc_timestamp

    record = run_record([Path(sys.executable).name, *sys.argv])
    rerun = {"command": record["command"], "utc": utc_timestamp(zulu=True), "git_revision": record["git_revision"],
             "steps": [s["step"] for s in document["steps"]], "write": document["checkpoint"].get("command")}  # fmt: skip
    # the earlier run's record (command, time, machine) stays: write_result keeps a payload's own
    return {**earlier, "steps": steps, "reruns": [*earlier.get("reruns", []), rerun]}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_measure"]:  # inside a measured process: _measure MARKER -- moee args
        marker, rest = Path(argv[1]), argv[3:]
        _instrument(marker)
        if rest[:1] == ["_oracle"]:
            return oracle_main(rest[1], rest[2], rest[3:])
        if rest[:1] == ["_capture"]:
            return capture_main(rest[1], rest[2], int(rest[3]), int(rest[4]), rest[5:])
        from moee.cli import main as moee_main

        return moee_main(rest)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="write a checkpoint folder of a named configuration")
    w.add_argument("name", choices=sorted(CONFIGS))
    w.add_argument("--out", required=True, type=Path, help="the folder to create (must not exist)")
    w.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers (default: all)")
    w.add_argument("--tiny", action="store_true", help="test widths (hidden 64, 8 experts top-2)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--shard-size", type=float, default=2.0, help="GB per safetensors shard (default: 2)")
    w.add_argument("--max-length", type=int, default=512, help="the tokenizer's model length (default: 512)")
    r = sub.add_parser("run", help="run moee's commands on a written folder, measured")
    r.add_argument("folder")
    r.add_argument("--texts", type=int, default=200, help="texts for embed, routes, ablate and serve")
    r.add_argument("--report-tokens", type=lambda s: [int(x) for x in s.split(",")], default=[5000, 20000])
    r.add_argument("--ablate-tokens", type=int, default=512, help="tokens `moee ablate` uses")
    r.add_argument("--batch-size", type=int, default=8)
    r.add_argument("--steps", default="embed,evaluate,report,routes,ablate,serve,capture,oracle")
    r.add_argument(
        "--capture-repeats",
        type=int,
        default=12,
        help="interleaved pairs the capture step times (default: 12; single pairs spread by about 10%%, "
        "so fewer leave the median ratio at the mercy of one slow forward)",
    )
    r.add_argument(
        "--load-flags",
        default=None,
        help="more loading flags, e.g. '--device-map auto --max-memory cpu=8GiB'",
    )
    r.add_argument("--timeout", type=float, default=1800, help="seconds each step may run")
    r.add_argument(
        "--work", default=None, help="folder for the steps' outputs (default: beside the checkpoint)"
    )
    r.add_argument(
        "--result",
        type=Path,
        default=None,
        help="result JSON (default: bench/results/rehearsal/<folder>.json)",
    )
    r.add_argument(
        "--delete", action="store_true", help="remove the checkpoint and the steps' outputs afterwards"
    )
    r.add_argument(
        "--rerun",
        action="store_true",
        help="replace only the --steps run now in the existing result (a step rerun after a fix); the "
        "result keeps the other steps and records each rerun's command, time and revision",
    )
    args = parser.parse_args(argv)
    if args.command == "run" and args.capture_repeats < 1:
        parser.error(f"--capture-repeats must be at least 1, got {args.capture_repeats}")
    if args.command == "write":
        manifest = write_checkpoint(
            args.name,
            args.out,
            layers=args.layers,
            tiny=args.tiny,
            seed=args.seed,
            shard_bytes=int(args.shard_size * 1e9),
            max_length=args.max_length,
            command=shlex.join(["python", "scripts/rehearse_real_size.py", *argv]),
        )
        print(json.dumps(manifest, indent=2))
        return 0
    from moee.benchmarking import write_result

    document = run_rehearsal(args)
    name = Path(args.folder).name
    result = args.result or RESULTS / f"{name}.json"
    if args.rerun:
        document = rerun_into(result, document)
    path = write_result(result.stem, document, out_dir=result.parent)
    print(f"wrote {path}")
    failed = [s["step"] for s in document["steps"] if s.get("returncode") or s.get("error")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
