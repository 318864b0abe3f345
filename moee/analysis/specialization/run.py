"""``moee report`` as one library call: :func:`run_report` builds the expert-specialization report
that :class:`moee.analysis.settings.ReportSettings` describes (checked when the settings are built)
and writes it. Every input is checked before the first model is routed: the output folder, each
model path or Hub id, the corpus (read through once), the ``moee ablate`` results."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
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


def run_report(
    settings: ReportSettings, *, command: Sequence[str] | None = None, progress: bool = True
) -> tuple[dict[str, Any], dict[str, Path]]:
    """The report of ``settings`` written to ``settings.out`` (``report.json`` and ``report.html``,
    committed together); ``command`` is recorded in its ``meta`` (default: ``sys.argv``). Returns
    the report and the written paths."""
    from moee.analysis.specialization import (
        build_report,
        compare_section,
        load_embedder,
        read_corpus,
        routing_overlap,
        saturation_section,
        write_report,
    )
    from moee.analysis.specialization.report import _resolve_top_k, check_corpus, check_report_folder
    from moee.analysis.specialization.sections.ablation import ablation_section, read_ablation
    from moee.analysis.specialization.sections.router_swap import read_swap, router_swap_section
    from moee.analysis.specialization.sections.steering import read_steering, steering_section
    from moee.embed.embedder import MoEEmbedder
    from moee.io import run_metadata

    s, options = settings, settings.load
    # every input before the first model loads: the output folder, each model, the corpus
    check_report_folder(s.out, overwrite=s.overwrite, inputs=s.inputs())
    specs = [("--model", s.model)] if s.model is not None else []
    specs += [("--checkpoints", c) for c in s.checkpoints or ()]
    specs += [("--compare", s.compare)] if s.compare is not None else []
    for flag, spec in specs:
        check_model_spec(flag, spec, hub=flag != "--model")
    total = check_corpus(s.corpus, text_field=s.field, domain_field=s.domain_field, max_texts=s.max_texts)
    # each `moee ablate` result: read and checked now, matched to the model once it loads
    causal: dict[str, Any] = {}
    if s.ablation is not None:
        causal["ablation"] = (ablation_section, read_ablation(s.ablation))
    if s.router_swap is not None:
        causal["router_swap"] = (router_swap_section, read_swap(s.router_swap))
    if s.steering is not None:
        causal["steering"] = (steering_section, [read_steering(path) for path in s.steering])

    def corpus():
        return read_corpus(s.corpus, text_field=s.field, domain_field=s.domain_field)

    if s.model is None and s.checkpoints:
        embedder = None  # the final checkpoint's report, loaded once the order is known
    else:
        embedder = MoEEmbedder.from_pretrained(s.model, options)
    tokenizer = embedder.tokenizer if embedder is not None else None

    def load(spec):
        return load_embedder(spec, options, tokenizer=tokenizer)

    build = dict(
        top_k=s.top_k,
        batch_size=s.batch_size,
        max_texts=s.max_texts,
        permutations=s.permutations,
        seed=s.seed,
        progress=progress,
        total=total,
        token_view_texts=s.token_view_texts,
        token_view_tokens=s.token_view_tokens,
    )

    def limited():
        rows = corpus()
        return rows if s.max_texts is None else itertools.islice(rows, s.max_texts)

    saturation = None
    if s.checkpoints:
        k = s.top_k
        if k is None:
            probe = embedder or load(s.checkpoints[-1])
            k = _resolve_top_k(probe, None)[0]
        saturation = saturation_section(
            list(s.checkpoints),
            limited(),
            top_k=k,
            load=load,
            max_tokens=s.overlap_tokens,
            batch_size=s.batch_size,
            progress=progress,
            model_tokenizer=tokenizer,
            model_name=s.model,
        )
        if embedder is None:
            embedder = load(saturation["final"])
    parts = {}
    if causal:  # against the report's model before its texts are routed
        from moee.embed.reference import weights_digest

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
    report = build_report(embedder, corpus(), **build)
    if saturation is not None:
        report["saturation"] = saturation
    report.update(parts)
    report["meta"] = {
        **run_metadata(list(command) if command is not None else None),
        "corpus": str(s.corpus),
        "domain_field": s.domain_field,
    }
    if saturation is not None:  # which checkpoint series the saturation section describes
        report["meta"]["saturation_source"] = {
            "final": saturation["final"],
            "same_tokenization_as_model": saturation["tokenization"]["same_as_model"],
        }
    if s.compare is not None:
        other = load(s.compare)
        report_b = build_report(other, corpus(), **build)
        overlap = routing_overlap(
            embedder,
            [other],
            limited(),
            top_k=report["summary"]["top_k"],
            max_tokens=s.overlap_tokens,
            batch_size=s.batch_size,
            progress=progress,
        )[0]
        report["compare"] = compare_section(
            report, report_b, overlap, [report["summary"]["model"], s.compare]
        )
    paths = write_report(report, s.out, overwrite=s.overwrite, progress=progress, inputs=s.inputs())
    return report, paths
