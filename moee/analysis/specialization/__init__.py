"""Expert-specialization report: what each router does, token by token, over a user's corpus.

Token-level routes come from ``MoEEmbedder.iter_token_routes`` one text at a time and are folded
into fixed-size accumulators (``SpecializationAccumulator``), so memory depends on the model
(its vocabulary x layers x experts, capped by ``TOKEN_TABLE_BYTES``), a few top-context slots and a
bounded sample of token routes for the baselines, never on the corpus length. Statistics, for MoE layer ``l``,
expert ``E``, k = the model's top-k:

* selection: the experts the router itself chose (its top-k indices, group limits and biases
  included) wherever the capture returns them; otherwise re-derived as the top k of what the
  router ranks: its softmax for plain top-k routers, its scores plus the selection-only bias for
  loss-free / DeepSeek-V3-style routers (``selection_scorers``). The report says which
  (``summary.selection``). The first choice is the selected expert with the highest score;
* load ``N_k(E)``: tokens whose top-k contains E; importance: sum over tokens of E's dense router
  probability (the softmax over all experts, i.e. Shazeer's ``G_sigma``, before top-k);
  ``CV = std/mean`` with the population std (the convention of Shazeer et al. 2017, as in
  ``moee.moe.losses``);
  ``max/mean`` load, the mean being ``N * k / E``;
* routing entropy: mean per-token entropy of the dense distribution (nats, and divided by log E);
* top tokens/contexts per expert: the token ids E selects most often (``N_k(x, E)``) and the
  contexts (a window of tokens around the position) with the highest router probability for E,
  like the expert contexts of Shazeer et al. 2017 (Table 9, experts 381/752/2004);
* domain specialization ``N_k(E, D) / N_D`` (fraction of domain D's tokens routed to E; OLMoE
  paper, section 5), summarised per layer by ``max_E``;
* vocabulary specialization ``N_k(x, E) / N_x`` for tokens x seen at least ``min_token_count`` times;
  summarised per layer as the token-weighted mean of ``max_E N_k(x, E) / N_x``;
* co-activation ``N(Ei, Ej) / N(Ei)``: of the tokens that selected Ei, the fraction also selecting Ej;
* repetition: the rate at which consecutive tokens of a text keep the same first choice (Mixtral
  paper, section 5);
* layer-to-layer agreement between the first choices of adjacent MoE layers: NMI from the joint
  counts and the exact match under the best one-to-one expert matching (expert ids of different
  layers are unrelated, so raw id equality would be meaningless).

Baselines (``SpecializationAccumulator.baselines``): each statistic recomputed with the routes
shuffled against what it relates them to (tokens, domains, positions, the other layer), seeded,
keeping what the statistic conditions on: token statistics draw only the routes of the tokens they
count, the domain labels are dealt out to whole texts, repetition shuffles within each text, and
co-activation takes its maximum over pairs on a null sample of as many tokens with every expert's
load and k distinct experts a token (docs/SPECIALIZATION.md lists each null).
Closed forms such as ``k / E`` or ``1 / E`` are not baselines of these statistics: a maximum over
experts of a few counts is far above ``k / E`` by chance alone, and a finite-sample NMI or
best matching is above ``1 / E``.

``build_report`` runs a model over a corpus and returns the JSON-ready dict; ``write_report``
writes ``report.json`` plus a self-contained ``report.html`` (plots as base64 PNG).

The report is a registry of sections (``sections``: one module per section, holding what it
tallies per text, its baseline, its JSON part and its page part); ``statistics`` holds the shared
heavy state (token tables, route sample) and math, ``accumulator`` streams the texts into the
shared state and every section's tally, ``report`` drives the model and assembles ``report.json``,
``html`` assembles the page. The public names are re-exported here.
"""

from __future__ import annotations

# the helpers the tests check directly, importable from here as before the split
from moee.analysis.overlap import matched_from_table as _matched_from_table  # noqa: F401
from moee.analysis.overlap import nmi_from_table as _nmi_from_table  # noqa: F401
from moee.analysis.specialization.accumulator import BaselineDraws, SpecializationAccumulator
from moee.analysis.specialization.html import render_html
from moee.analysis.specialization.report import (
    REPORT_SECTIONS,
    SELECTION_CAPTURE_DERIVED,
    SELECTION_RETURNED,
    TOP_K_ATTRIBUTES,
    ReportedModel,
    ReportOptions,
    build_report,
    checkpoint_step,
    compare_section,
    lm_head,
    load_embedder,
    model_top_k,
    read_corpus,
    routing_overlap,
    same_tokenization,
    saturation_section,
    selection_scorers,
    write_report,
)
from moee.analysis.specialization.sections import SECTIONS
from moee.analysis.specialization.statistics import (  # noqa: F401
    BASELINE_SAMPLE_BYTES,
    TOKEN_KEYS,
    TOKEN_TABLE_BYTES,
    _cv,
    _entropy,
    _group_blocks,
    _permuted_group_max,
    _random_table,
)

__all__ = [
    "TOP_K_ATTRIBUTES",
    "model_top_k",
    "selection_scorers",
    "read_corpus",
    "BaselineDraws",
    "SpecializationAccumulator",
    "BASELINE_SAMPLE_BYTES",
    "SELECTION_RETURNED",
    "SELECTION_CAPTURE_DERIVED",
    "build_report",
    "ReportedModel",
    "ReportOptions",
    "render_html",
    "write_report",
    "REPORT_SECTIONS",
    "SECTIONS",
    "TOKEN_KEYS",
    "TOKEN_TABLE_BYTES",
    "lm_head",
    "routing_overlap",
    "checkpoint_step",
    "load_embedder",
    "saturation_section",
    "same_tokenization",
    "compare_section",
]
