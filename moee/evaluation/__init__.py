"""MTEB evaluation: the mteb adapter, offline tasks, the paper's suite, alpha, result tables.

- ``adapter``: ``MoEEMTEBEncoder`` (a ``MoEEmbedder`` as an mteb encoder), ``get_model`` (the
  encoder of a model and configuration, like ``mteb.get_model``), ``TraceCache``,
  ``load_baseline_encoder`` (all-MiniLM-L6-v2);
- ``tasks``: mteb tasks over the committed offline data (``offline_tasks``);
- ``paper``: the paper's 19 tasks and published numbers;
- ``alpha``: the label-free MoEE(sum) weight and its sensitivity curve;
- ``runner``: ``run_evaluation`` (what ``moee evaluate`` and ``moee quickstart`` call);
- ``tables``: per-task and per-family tables from an ``mteb.ResultCache`` folder.

Names are re-exported lazily, so ``import moee.evaluation`` does not import mteb.
"""

from __future__ import annotations

from importlib import import_module

_EXPORTS = {
    "MoEEMTEBEncoder": "adapter",
    "get_model": "adapter",
    "TraceCache": "adapter",
    "load_baseline_encoder": "adapter",
    "offline_tasks": "tasks",
    "choose_alpha": "alpha",
    "EvalSettings": "settings",
    "QuickstartSettings": "settings",
    "run_evaluation": "runner",
    "write_tables": "tables",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(f"moee.evaluation.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'moee.evaluation' has no attribute {name!r}")
