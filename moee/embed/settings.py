"""The settings of the embedding commands: one frozen dataclass per command (``moee embed``:
:class:`EmbedSettings`, ``moee fit-reference``: :class:`FitReferenceSettings`), one field per flag
(``moee.cli_options`` builds the flags from the fields' metadata; the configuration flags are the
embedded ``EmbeddingConfig``'s, the loading flags ``LoadOptions``'), each value checked once when
built, with errors naming the flag, so the library functions they configure
(``moee.embed_corpus.run_embed``, ``moee.corpus.run_fit_reference``) trust them. The configuration
they hold is resolved: the flags given, else the model's saved configuration, else the library
default. Standard library and the configuration classes only: the command line's parser imports
this module without torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from dataclasses import field as _field  # a settings field is named `field` (--field)
from pathlib import Path
from typing import Any

from moee.embed.config import EmbeddingConfig, paper_field
from moee.embed.validation import check_positive_int
from moee.loading import LoadOptions
from moee.models.bundled import model_field

__all__ = [
    "DEFAULT_CHUNK",
    "FIT_REFERENCE_NOT_FLAGS",
    "MODEL_REFERENCE",
    "EmbedSettings",
    "FitReferenceSettings",
]

#: Texts ``moee embed`` reads and embeds at a time by default.
DEFAULT_CHUNK = 4096
#: The file stem of the statistics ``moee fit-reference --save-to-model`` writes into a model folder.
MODEL_REFERENCE = "reference"


def _load() -> Any:
    return _field(default_factory=LoadOptions, metadata={"embed": LoadOptions})


def _text_field() -> Any:
    return _field(
        default=None,
        metadata={"help": "JSON key / parquet column holding the text", "default_text": "text"},
    )


def _batch_size() -> Any:
    return _field(default=32, metadata={"help": "texts per forward", "type": int})


def _check_count(flag: str, value: Any) -> None:
    """``value`` unset or an int >= 1 (``--batch-size must be >= 1, got 0``)."""
    if value is not None:
        check_positive_int(flag, value)


def _check_number(flag: str, value: Any) -> None:
    """``value`` unset or a finite number >= 0."""
    if value is None:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"{flag} must be a finite number >= 0, got {value!r}")


# ---------------------------------------------------------------------------- moee embed
@dataclass(frozen=True, kw_only=True)
class EmbedSettings:
    """What ``moee embed`` writes (``moee.embed_corpus.run_embed``): one ``.npy`` and its sidecar,
    one shard per process (``sharded``), a Parquet folder on a Ray cluster (``engine="ray"``), or
    the merge of a shard folder (``merge``)."""

    input: str | None = _field(
        default=None,
        metadata={
            "help": "texts: .txt (one per line; blank lines are kept as empty texts), .jsonl or .parquet "
            "(see --field)",
            "positional": True,
            "nargs": "?",
        },
    )
    out: str = _field(
        metadata={"help": "output .npy (or, with --sharded, a directory; with --merge, the merged .npy)"}
    )
    overwrite: bool = _field(
        default=False,
        metadata={"help": "replace an existing --out .npy (without it an existing output is an error)"},
    )
    model: str | None = model_field()
    load: LoadOptions = _load()
    config: EmbeddingConfig = _field(default_factory=EmbeddingConfig, metadata={"embed": EmbeddingConfig})
    paper: bool = paper_field()
    batch_size: int = _batch_size()
    no_progress: bool = _field(
        default=False,
        metadata={
            "help": "no progress bar (by default a bar of texts done / total is shown on stderr when it is "
            "a terminal)"
        },
    )
    field: str | None = _text_field()
    chunk_size: int = _field(
        default=DEFAULT_CHUNK,
        metadata={
            "help": "texts read and embedded at a time (bounds memory; sorting by length happens within "
            "a chunk)",
            "type": int,
        },
    )
    engine: str = _field(
        default="local",
        metadata={
            "help": "local: this process (or --sharded processes); ray: an actor pool on a Ray cluster, "
            "INPUT a file, folder or glob of .jsonl/.parquet/.txt, --out a folder of Parquet files",
            "choices": ("local", "ray"),
            "group": "embed-ray",
        },
    )
    address: str | None = _field(
        default=None,
        metadata={
            "help": "Ray cluster to join",
            "default_text": "start a local one",
            "group": "embed-ray",
        },
    )
    concurrency: int = _field(
        default=1, metadata={"help": "Ray actors (model copies)", "type": int, "group": "embed-ray"}
    )
    num_gpus: float | None = _field(
        default=None,
        metadata={
            "help": "GPUs per Ray actor",
            "type": float,
            "default_text": "1 if the cluster has GPUs",
            "group": "embed-ray",
        },
    )
    id_field: str | None = _field(
        default=None,
        metadata={
            "help": "input column kept beside row and text in the Parquet output",
            "group": "embed-ray",
        },
    )
    sharded: bool = _field(
        default=False,
        metadata={
            "help": "write one shard per process into the --out directory",
            "group": "embed-sharding",
        },
    )
    shard_rank: int | None = _field(
        default=None,
        metadata={
            "help": "this process' shard",
            "type": int,
            "default_text": "$RANK or 0",
            "group": "embed-sharding",
        },
    )
    num_shards: int | None = _field(
        default=None,
        metadata={
            "help": "number of shards",
            "type": int,
            "default_text": "$WORLD_SIZE or 1",
            "group": "embed-sharding",
        },
    )
    auto_merge: bool = _field(
        default=True,
        metadata={"help": "rank 0 does not merge", "flag": "--no-merge", "group": "embed-sharding"},
    )
    merge_timeout: float = _field(
        default=3600.0,
        metadata={
            "help": "seconds rank 0 waits for the other shards",
            "type": float,
            "group": "embed-sharding",
        },
    )
    merge: str | None = _field(
        default=None,
        metadata={
            "help": "merge the shards of DIR into --out and exit",
            "metavar": "DIR",
            "group": "embed-sharding",
        },
    )

    def __post_init__(self) -> None:
        if self.merge is not None:
            if self.input is not None or self.sharded:
                raise ValueError(
                    "--merge DIR takes no INPUT and no --sharded; it only merges existing shards"
                )
            return  # the merge reads only --merge and --out
        if self.input is None:
            raise ValueError("INPUT is required (or use --merge DIR)")
        for flag, value in (
            ("--batch-size", self.batch_size),
            ("--chunk-size", self.chunk_size),
            ("--concurrency", self.concurrency),
        ):
            _check_count(flag, value)
        _check_number("--num-gpus", self.num_gpus)
        _check_number("--merge-timeout", self.merge_timeout)
        if self.engine == "ray":
            if self.sharded or self.shard_rank is not None or self.num_shards is not None:
                raise ValueError("--engine ray shards by itself; drop --sharded/--shard-rank/--num-shards")
            return
        if self.id_field is not None or self.address is not None:
            raise ValueError("--id-field/--address need --engine ray")
        if not self.sharded:
            if self.shard_rank is not None or self.num_shards is not None:
                raise ValueError("--shard-rank/--num-shards need --sharded")
            if Path(self.out).suffix != ".npy":
                raise ValueError(
                    f"--out must be a .npy file (got {self.out}); use --sharded to write a directory"
                )
        elif Path(self.out).suffix == ".npy":
            raise ValueError(f"with --sharded, --out is a directory, got {self.out}")

    @property
    def progress(self) -> bool | None:
        """The progress bar: off with ``--no-progress``, else shown when stderr is a terminal (``None``)."""
        return False if self.no_progress else None

    def record(self) -> dict[str, Any]:
        """Everything that changes the numbers; recorded in sidecars and shard manifests."""
        record = {
            "model": self.model,
            **self.config.to_dict(),
            "model_dtype": self.load.dtype,  # the weights dtype; the array is always float32 (array_dtype)
            "load_in_4bit": self.load.load_in_4bit,
        }
        if self.config.reference is not None:  # its numbers, not its path: a re-fit is another run
            record["reference_sha256"] = self.config.reference_digest()
        return record


# ---------------------------------------------------------------------------- moee fit-reference
#: Configuration fields without a flag in ``moee fit-reference``: they do not change the features a
#: reference fits.
FIT_REFERENCE_NOT_FLAGS = {
    "method": "the statistics are of HS and RW, before any method combines them",
    "alpha": "the statistics are of HS and RW, before any method combines them",
    "normalize": "the statistics are of HS and RW, before any method combines them",
    "reference": "fit-reference writes a reference (--out)",
}


@dataclass(frozen=True, kw_only=True)
class FitReferenceSettings:
    """What ``moee fit-reference`` fits (``moee.corpus.run_fit_reference``): the statistics of
    ``corpus`` under ``config`` (resolved against ``save_to_model``'s folder when ``model`` is
    unset; a reference is what it writes, so the configuration holds none), written to ``out`` or
    into the model folder ``save_to_model``."""

    corpus: str = _field(
        metadata={"help": "texts: .txt (one per line), .jsonl or .parquet (see --field)", "positional": True}
    )
    out: str | None = _field(
        default=None,
        metadata={
            "help": "output path; OUT.safetensors and OUT.json are written",
            "exclusive": "output",
            "required": True,
        },
    )
    save_to_model: str | None = _field(
        default=None,
        metadata={
            "help": "fit on the model folder DIR (the model, unless --model names the same folder) and make "
            "the statistics part of its configuration: DIR/reference.{safetensors,json}, and "
            "DIR/moee_embedding.json records the configuration fitted under (the model's own, changed by "
            "any flag given) with them",
            "metavar": "DIR",
            "exclusive": "output",
        },
    )
    overwrite: bool = _field(
        default=False, metadata={"help": "replace an existing reference (else it is an error)"}
    )
    field: str | None = _text_field()
    max_texts: int | None = _field(
        default=None,
        metadata={"help": "use only the first N texts of the corpus (deterministic)", "type": int},
    )
    model: str | None = model_field()
    load: LoadOptions = _load()
    config: EmbeddingConfig = _field(
        default_factory=EmbeddingConfig,
        metadata={
            "embed": EmbeddingConfig,
            "exclude": FIT_REFERENCE_NOT_FLAGS,
            "model_from": ("model", "save_to_model"),
        },
    )
    paper: bool = paper_field()
    batch_size: int = _batch_size()

    def __post_init__(self) -> None:
        if (self.out is None) == (self.save_to_model is None):
            raise ValueError("give one of --out and --save-to-model")
        _check_count("--max-texts", self.max_texts)
        _check_count("--batch-size", self.batch_size)
        if self.config.reference is not None:  # the model's own reference: not what is fitted under
            object.__setattr__(self, "config", self.config.replace(reference=None))
        if self.save_to_model is not None:
            folder = self.model_folder
            if not (folder / "config.json").is_file():
                raise ValueError(
                    f"--save-to-model {self.save_to_model} is not a local model folder (it has no "
                    "config.json); save the model there first (MoEEmbedder.save_pretrained)"
                )
            if self.model is None:
                object.__setattr__(self, "model", str(folder))
            elif Path(self.model).expanduser().resolve() != folder:
                raise ValueError(
                    f"--save-to-model {self.save_to_model} and --model {self.model} differ; the statistics "
                    "belong to the model they are fitted on (leave --model out)"
                )

    @property
    def model_folder(self) -> Path | None:
        """The model folder ``--save-to-model`` names (``None`` without it)."""
        return Path(self.save_to_model).expanduser().resolve() if self.save_to_model is not None else None

    @property
    def target(self) -> Path | str:
        """Where the statistics go: ``--out``, or the model folder's :data:`MODEL_REFERENCE`."""
        folder = self.model_folder
        return folder / MODEL_REFERENCE if folder is not None else self.out
