"""``moee report`` as one library call: :func:`run_report` builds the expert-specialization report
that :class:`moee.analysis.settings.ReportSettings` describes (checked when the settings are built)
and writes it. Every input is checked before the first model is routed: the output folder, each
model path or Hub id, the corpus (read through once), the ``moee ablate`` results."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moee.analysis.settings import ReportSettings

__all__ = ["check_model_spec", "run_report"]


def check_model_spec(flag: str, spec: str, *, hub: bool = True) -> None:
    """A model argument that cannot load is refused by flag before any model is routed: a missing
    or non-model local folder, or (``hub``) a Hub id (``name@revision``) whose config cannot be
    fetched (not cached offline). ``--model`` loads first, so its loader's own error comes first
    anyway and it is checked with ``hub=False``."""
    from moee.loading import check_model_source, split_revision

    name, revision = split_revision(spec)
    try:
        check_model_source(name)
    except OSError as exc:
        raise type(exc)(f"{flag} {spec}: {exc}") from None
    local = Path(name).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise FileNotFoundError(f"{flag} {spec}: {local} holds no config.json, it is not a model folder")
        return
    if not hub:
        return
    from transformers.utils import cached_file

    try:
        cached_file(name, "config.json", revision=revision)
    except OSError as exc:
        raise FileNotFoundError(f"{flag} {spec}: cannot find this model ({exc})") from None


def _check_inputs(s: ReportSettings) -> tuple[int | None, dict[str, Any]]:
    """Every input before the first model loads: the output folder, each model, the corpus (its
    text count returned) and each ``moee ablate`` result (read and checked now, matched to the
    model once it loads: section key -> (section builder, result))."""
    from moee.analysis.specialization.report import check_corpus, check_report_folder
    from moee.analysis.specialization.sections.ablation import ablation_section, read_ablation
    from moee.analysis.specialization.sections.router_swap import read_swap, router_swap_section
    from moee.analysis.specialization.sections.steering import read_steering, steering_section

    check_report_folder(s.out, overwrite=s.overwrite, inputs=s.inputs())
    specs = [("--model", s.model)] if s.model is not None else []
    specs += [("--checkpoints", c) for c in s.checkpoints or ()]
    specs += [("--compare", s.compare)] if s.compare is not None else []
    for flag, spec in specs:
        check_model_spec(flag, spec, hub=flag != "--model")
    total = check_corpus(s.corpus, text_field=s.field, domain_field=s.domain_field, max_texts=s.max_texts)
    causal: dict[str, Any] = {}
    if s.ablation is not None:
        causal["ablation"] = (ablation_section, read_ablation(s.ablation))
    if s.router_swap is not None:
        causal["router_swap"] = (router_swap_section, read_swap(s.router_swap))
    if s.steering is not None:
        causal["steering"] = (steering_section, [read_steering(path) for path in s.steering])
    return total, causal


def _saturation(
    s: ReportSettings,
    embedder: Any,
    load: Callable[[str], Any],
    limited: Callable[[], Any],
    tokenizer: Any,
    progress: bool,
) -> dict:
    """The router-saturation section over ``s.checkpoints`` (k from the model, else the final
    checkpoint, when ``s.top_k`` is not given)."""
    from moee.analysis.specialization import ReportedModel, saturation_section
    from moee.analysis.specialization.report import _resolve_top_k

    k = s.top_k
    if k is None:
        probe = embedder or load(s.checkpoints[-1])
        k = _resolve_top_k(probe, None)[0]
    return saturation_section(
        list(s.checkpoints),
        limited(),
        top_k=k,
        load=load,
        max_tokens=s.overlap_tokens,
        batch_size=s.batch_size,
        progress=progress,
        model=ReportedModel(s.model, tokenizer),
    )


def _causal_parts(s: ReportSettings, causal: dict[str, Any], embedder: Any, saturation: dict | None) -> dict:
    """The ``moee ablate`` sections, checked against the report's model before its texts are routed."""
    from moee.embed.reference import weights_digest

    parts = {}
    results = [r for _, given in causal.values() for r in (given if isinstance(given, list) else [given])]
    recorded = any((r.get("meta") or {}).get("weights_digest") is not None for r in results)
    digest = weights_digest(embedder) if recorded else None
    for key, (section, given) in causal.items():
        parts[key] = section(
            given,
            model=s.model if s.model is not None or saturation is None else saturation["final"],
            n_layers=int(embedder.n_moe_layers),
            n_experts=int(embedder.n_experts),
            weights_digest=digest,
        )
    return parts


def _meta(s: ReportSettings, command: Sequence[str] | None, saturation: dict | None) -> dict:
    """The report's ``meta``: the run, the corpus and which checkpoint series saturation describes."""
    from moee.io import run_metadata

    meta = {
        **run_metadata(list(command) if command is not None else None),
        "corpus": str(s.corpus),
        "domain_field": s.domain_field,
    }
    if saturation is not None:  # which checkpoint series the saturation section describes
        meta["saturation_source"] = {
            "final": saturation["final"],
            "same_tokenization_as_model": saturation["tokenization"]["same_as_model"],
        }
    return meta


def _compare(
    s: ReportSettings,
    report: dict,
    embedder: Any,
    other: Any,
    corpus: Callable[[], Any],
    limited: Callable[[], Any],
    build: dict,
) -> dict:
    """The comparison section: ``other``'s own report (over the corpus once more) and the routing
    overlap with it on the first ``s.overlap_tokens`` tokens (of the ``limited`` corpus)."""
    from moee.analysis.specialization import build_report, compare_section, routing_overlap

    report_b = build_report(other, corpus(), **build)
    overlap = routing_overlap(
        embedder,
        [other],
        limited(),
        top_k=report["summary"]["top_k"],
        max_tokens=s.overlap_tokens,
        batch_size=s.batch_size,
        progress=build["progress"],
    )[0]
    return compare_section(report, report_b, overlap, [report["summary"]["model"], s.compare])


def run_report(
    settings: ReportSettings, *, command: Sequence[str] | None = None, progress: bool = True
) -> tuple[dict[str, Any], dict[str, Path]]:
    """The report of ``settings`` written to ``settings.out`` (``report.json`` and ``report.html``,
    committed together); ``command`` is recorded in its ``meta`` (default: ``sys.argv``). Returns
    the report and the written paths."""
    from moee.analysis.specialization import (
        BaselineDraws,
        ReportOptions,
        build_report,
        load_embedder,
        read_corpus,
        write_report,
    )
    from moee.embed.embedder import MoEEmbedder

    s, options = settings, settings.load
    total, causal = _check_inputs(s)

    def corpus():
        return read_corpus(s.corpus, text_field=s.field, domain_field=s.domain_field)

    if s.model is None and s.checkpoints:
        embedder = None  # the final checkpoint's report, loaded once the order is known
    else:
        embedder = MoEEmbedder.from_pretrained(s.model, options)
    tokenizer = embedder.tokenizer if embedder is not None else None

    def load(spec):
        return load_embedder(spec, options, tokenizer=tokenizer)

    counted = ReportOptions(
        top_k=s.top_k,
        draws=BaselineDraws(s.permutations, s.seed),
        token_view_texts=s.token_view_texts,
        token_view_tokens=s.token_view_tokens,
    )
    build = dict(
        options=counted, batch_size=s.batch_size, max_texts=s.max_texts, progress=progress, total=total
    )

    def limited():
        rows = corpus()
        return rows if s.max_texts is None else itertools.islice(rows, s.max_texts)

    saturation = None
    if s.checkpoints:
        saturation = _saturation(s, embedder, load, limited, tokenizer, progress)
        if embedder is None:
            embedder = load(saturation["final"])
    parts = _causal_parts(s, causal, embedder, saturation) if causal else {}
    report = build_report(embedder, corpus(), **build)
    if saturation is not None:
        report["saturation"] = saturation
    report.update(parts)
    report["meta"] = _meta(s, command, saturation)
    if s.compare is not None:
        other = load(s.compare)
        report["compare"] = _compare(s, report, embedder, other, corpus, limited, build)
    paths = write_report(report, s.out, overwrite=s.overwrite, progress=progress, inputs=s.inputs())
    return report, paths
