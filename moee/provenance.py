"""Run records: what every result file says about how it was made.

One home for provenance, so every writer (embedding sidecars, analysis ``meta`` blocks, the
evaluation's ``run`` block, benchmark results, the data builders' manifests) records the same
things the same way: package versions (read from installed metadata, without importing the
packages), the command line, the UTC time, the git revision of the checkout when there is one,
the machine where a figure depends on it, and SHA-256 hashes of files.

Writers keep their own key names where committed files already use them (``timestamp`` in
``meta`` blocks, ``utc`` in benchmark results), so old and new files read alike.
"""

from __future__ import annotations

import datetime as _dt
import functools
import hashlib
import os
import platform
import re
import shlex
import subprocess
import sys
from collections.abc import Sequence
from importlib import metadata as _metadata
from pathlib import Path
from typing import Any

__all__ = [
    "CORE_PACKAGES",
    "ALTERNATIVE_PACKAGES",
    "package_versions",
    "command_string",
    "utc_timestamp",
    "git_revision",
    "machine_info",
    "file_sha256",
    "run_record",
    "note_quantization",
    "quantization_record",
]

#: The libraries that determine the numbers of any run.
CORE_PACKAGES = ("moee", "torch", "transformers", "numpy", "mteb", "faiss-cpu", "faiss-gpu-cu12")
#: Alternative wheels of one library: by default only the installed one is recorded.
ALTERNATIVE_PACKAGES = ("faiss-cpu", "faiss-gpu-cu12")

_HASH_BLOCK = 1 << 24  # bytes read at a time when hashing a file


def package_versions(
    packages: Sequence[str] = CORE_PACKAGES,
    *,
    missing: str | None = None,
    omit_missing: Sequence[str] = ALTERNATIVE_PACKAGES,
) -> dict[str, str | None]:
    """``python`` plus each package's installed version, in the order given.

    A package that is not installed is recorded as ``missing`` (``None`` by default), or left out
    when it is in ``omit_missing``; ``moee`` run from a checkout that is not pip-installed is
    recorded as its ``__version__``.
    """
    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in packages:
        try:
            out[dist] = _metadata.version(dist)
        except _metadata.PackageNotFoundError:
            if dist == "moee":
                from moee import __version__

                out[dist] = __version__
            elif dist not in omit_missing:
                out[dist] = missing
    return out


def command_string(command: str | Sequence[str] | None = None) -> str:
    """The command line as one shell-quoted string (``sys.argv`` by default; a str is kept as is)."""
    if isinstance(command, str):
        return command
    return shlex.join(list(sys.argv if command is None else command))


ASSEMBLED_STAMP = "moee_assembled.json"
"""The file `moee.moe.delta.assemble` writes last into a folder it built from a base and a delta."""


def assembled_name(folder: str | os.PathLike) -> str | None:
    """The model name of a folder moee assembled into its cache (``<name>-<12 hex digits of the
    delta>`` holding `ASSEMBLED_STAMP`), else ``None``: the folder's suffix changes with every new
    delta, while the name, with the weights' digest beside it, is what a result should carry."""
    path = Path(folder)
    match = re.fullmatch(r"(.+)-[0-9a-f]{12}", path.name)
    if match is None or not (path / ASSEMBLED_STAMP).is_file():
        return None
    return match.group(1)


def model_label(name_or_path: str | os.PathLike) -> str:
    """How a result file names its model: a Hub id or relative path as given, a local folder under
    the working directory (or a shipped model, under the moee package's parent) relative to it,
    a model assembled into moee's cache (or a file in it) by its name (`assembled_name`), so a result committed with
    the project does not carry the folder of the machine that made it; any other path as given (it
    names the user's own folder)."""
    text = str(name_or_path)
    path = Path(text).expanduser()
    if not path.is_absolute():
        return text
    path = path.resolve()
    for folder in (path, *path.parents):
        name = assembled_name(folder)
        if name is not None:
            return Path(name, path.relative_to(folder)).as_posix()
    for root in (Path.cwd().resolve(), Path(__file__).resolve().parent.parent):
        if path.is_relative_to(root):
            return path.relative_to(root).as_posix()
    return text


def utc_timestamp(*, zulu: bool = False) -> str:
    """The current UTC time to the second: ``2026-01-02T03:04:05+00:00`` (or ``...05Z``)."""
    now = _dt.datetime.now(_dt.timezone.utc)
    return now.strftime("%Y-%m-%dT%H:%M:%SZ") if zulu else now.isoformat(timespec="seconds")


@functools.lru_cache(maxsize=1)
def git_revision() -> str | None:
    """The commit of the moee checkout this code runs from (``+dirty`` when it has uncommitted
    changes to tracked files), or ``None`` for an installed package or without git."""
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")


def _cpuinfo(key: str) -> str | None:
    """The first value of ``key`` in /proc/cpuinfo (``None`` where there is none, e.g. not Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip().lower() == key:
                return value.strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    """The processor's model name (Linux), else what the platform module says."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def cpu_flags_digest() -> str:
    """A short digest of the processor's feature flags: two processors of one model name and
    kernel family can still round the last bit differently, so bit-exact comparisons key on it."""
    flags = " ".join(sorted((_cpuinfo("flags") or "").split()))
    return hashlib.sha256(flags.encode()).hexdigest()[:16]


def machine_info() -> dict[str, Any]:
    """CPU model, core counts, threads torch uses, memory and GPU (if any): enough to compare runs."""
    info: dict[str, Any] = {
        "cpu_model": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "platform": platform.platform(),
        "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    try:
        import psutil

        info["memory_gb"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        info["memory_gb"] = None
    import torch

    info["torch_threads"] = torch.get_num_threads()
    info["cuda"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def file_sha256(path: str | Path, *, offset: int = 0) -> str:
    """SHA-256 of ``path``'s bytes from ``offset`` on, read in blocks (memory stays bounded)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        while block := f.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


#: The 4-bit loads of this process: model label -> what was quantized
#: (:func:`moee.loading.quantization_summary`); every later run record carries them.
_QUANTIZED: dict[str, dict[str, Any]] = {}


def note_quantization(model: str | os.PathLike, summary: dict[str, Any]) -> None:
    """Record that ``model`` was loaded in 4 bit as ``summary`` says: every :func:`run_record`
    this process makes afterwards carries it (``quantization``), so a result says how much of its
    model ran in 4 bit, not only that 4 bit was asked for."""
    _QUANTIZED[model_label(model)] = dict(summary)


def quantization_record() -> dict[str, dict[str, Any]]:
    """The 4-bit loads of this process (:func:`note_quantization`), by model label."""
    return {name: dict(summary) for name, summary in _QUANTIZED.items()}


def run_record(
    command: str | Sequence[str] | None = None,
    *,
    packages: Sequence[str] = CORE_PACKAGES,
    extra: dict[str, Any] | None = None,
    machine: bool = False,
    missing: str | None = None,
    omit_missing: Sequence[str] = ALTERNATIVE_PACKAGES,
) -> dict[str, Any]:
    """``versions``, ``command``, ``timestamp`` (UTC), ``git_revision``, ``quantization`` after a
    4-bit load (:func:`note_quantization`) and, with ``machine=True`` (benchmarks, where the figures
    depend on it), ``machine``; then ``extra``."""
    record: dict[str, Any] = {
        "versions": package_versions(packages, missing=missing, omit_missing=omit_missing),
        "command": command_string(command),
        "timestamp": utc_timestamp(),
        "git_revision": git_revision(),
    }
    if _QUANTIZED:
        record["quantization"] = quantization_record()
    if machine:
        record["machine"] = machine_info()
    return {**record, **(extra or {})}
