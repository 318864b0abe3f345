"""The paper's evaluation suite and its published numbers, for side-by-side tables.

Li & Zhou, "Your Mixture-of-Experts LLM Is Secretly an Embedding Model For Free" (ICLR 2025,
arXiv 2410.10814 v1) evaluate on 19 MTEB tasks in six families. ``PAPER_TASKS`` lists them
(resolved by name with ``mteb.get_tasks``); ``paper_scores`` returns the published numbers
(Tables 3/4 for family averages, Table 8 for STS, Tables 9-12 for the rest) so that a run of
one of the paper's three models can print them next to ours.

The numbers are transcribed from the v1 HTML, in the tables' own row order, so that each row
can be checked against the paper by eye. Two known quirks of the paper are kept as published:
DeepSeekMoE no-prompt HS Reranking is 38.13 although its three tasks average 38.26, and
Table 12 repeats several DeepSeek values between the no-prompt and PromptEOL rows.
Note: mteb 2.x scores Reranking with ``map_at_1000`` over a retrieval-format conversion, so
our Reranking numbers are comparable in spirit, not digit for digit, with the mteb-1.14 ones.
"""

from __future__ import annotations

#: Family order used by the paper's tables (and by ours).
FAMILIES: tuple[str, ...] = (
    "Classification",
    "Clustering",
    "PairClassification",
    "Reranking",
    "STS",
    "Summarization",
)

#: The 19 tasks of the paper, by family, with mteb's task names.
PAPER_TASKS: dict[str, tuple[str, ...]] = {
    "Classification": (
        "EmotionClassification",
        "ToxicConversationsClassification",
        "TweetSentimentExtractionClassification",
    ),
    "Clustering": ("MedrxivClusteringS2S", "TwentyNewsgroupsClustering"),
    "PairClassification": ("TwitterSemEval2015", "TwitterURLCorpus"),
    "Reranking": ("AskUbuntuDupQuestions", "SciDocsRR", "StackOverflowDupQuestions"),
    "STS": ("STS12", "STS13", "STS14", "STS15", "STS16", "BIOSSES", "SICK-R", "STSBenchmark"),
    "Summarization": ("SummEval",),
}

#: The paper's three models: Hugging Face id -> short key used in the tables below.
PAPER_MODELS: dict[str, str] = {
    "deepseek-ai/deepseek-moe-16b-base": "deepseek",
    "Qwen/Qwen1.5-MoE-A2.7B": "qwen",
    "allenai/OLMoE-1B-7B-0924": "olmoe",
}

#: Paper prompt settings: "none" (Table 3) and "prompteol" (Table 4).
PAPER_PROMPTS: tuple[str, ...] = ("none", "prompteol")

# Tables 3 and 4: (model, prompt, method) -> (CLF, Clust, PairCLF, Rerank, STS, Summ, Avg).
# Table 8: -> (STS12, STS13, STS14, STS15, STS16, BIOSSES, SICK-R, STSB).
# Tables 9-12: -> (Tweet, Emotion, Toxic, TwURL, SemEval15, 20News, MedrxivS2S, AskUbuntu,
#                  SciDocsRR, StackOverflow).
_FAMILY_ROWS: dict[tuple[str, str, str], tuple[float, ...]] = {
    ("deepseek", "none", "hs"): (44.79, 25.87, 44.34, 38.13, 34.54, 24.51, 35.36),
    ("deepseek", "prompteol", "hs"): (58.24, 24.64, 48.76, 38.13, 59.66, 24.38, 42.30),
    ("deepseek", "none", "rw"): (44.06, 17.53, 50.59, 35.94, 41.11, 26.22, 35.91),
    ("deepseek", "prompteol", "rw"): (49.52, 19.97, 68.30, 37.48, 59.52, 29.26, 44.01),
    ("deepseek", "none", "moee_concat"): (44.93, 24.15, 51.88, 41.20, 46.82, 31.17, 40.03),
    ("deepseek", "prompteol", "moee_concat"): (54.21, 26.10, 72.44, 53.31, 67.59, 28.89, 50.42),
    ("deepseek", "none", "moee_sum"): (48.74, 32.83, 52.12, 47.88, 48.34, 29.89, 43.30),
    ("deepseek", "prompteol", "moee_sum"): (58.31, 34.52, 70.95, 55.99, 70.66, 29.22, 53.28),
    ("qwen", "none", "hs"): (46.41, 24.31, 44.43, 44.91, 28.36, 22.65, 35.18),
    ("qwen", "prompteol", "hs"): (59.34, 29.50, 74.29, 56.51, 67.39, 23.01, 51.67),
    ("qwen", "none", "rw"): (38.99, 10.55, 42.26, 33.53, 23.97, 27.44, 29.46),
    ("qwen", "prompteol", "rw"): (47.84, 16.74, 64.85, 43.55, 51.71, 27.74, 42.07),
    ("qwen", "none", "moee_concat"): (44.81, 26.75, 49.79, 49.23, 37.93, 27.61, 39.35),
    ("qwen", "prompteol", "moee_concat"): (54.23, 27.18, 73.93, 56.12, 68.52, 28.57, 51.43),
    ("qwen", "none", "moee_sum"): (50.70, 31.35, 51.87, 49.82, 45.75, 24.00, 42.25),
    ("qwen", "prompteol", "moee_sum"): (59.57, 38.33, 72.21, 56.25, 72.78, 31.09, 55.04),
    ("olmoe", "none", "hs"): (44.23, 23.79, 47.56, 45.60, 35.44, 20.94, 36.26),
    ("olmoe", "prompteol", "hs"): (58.18, 32.83, 72.10, 58.31, 72.91, 27.96, 53.72),
    ("olmoe", "none", "rw"): (43.54, 17.66, 53.12, 40.91, 44.68, 28.68, 38.10),
    ("olmoe", "prompteol", "rw"): (45.02, 19.93, 61.58, 43.91, 54.33, 29.49, 42.38),
    ("olmoe", "none", "moee_concat"): (44.62, 22.83, 51.64, 46.58, 48.84, 31.67, 41.03),
    ("olmoe", "prompteol", "moee_concat"): (52.59, 33.92, 71.85, 56.69, 71.13, 30.21, 52.73),
    ("olmoe", "none", "moee_sum"): (48.54, 30.67, 50.93, 47.77, 49.45, 28.77, 42.69),
    ("olmoe", "prompteol", "moee_sum"): (57.46, 36.46, 71.26, 60.43, 74.63, 30.71, 55.16),
}
_STS_ROWS: dict[tuple[str, str, str], tuple[float, ...]] = {
    ("deepseek", "none", "hs"): (20.90, 43.39, 24.02, 37.75, 47.15, 29.87, 42.66, 30.61),
    ("deepseek", "none", "rw"): (45.22, 41.38, 28.75, 38.63, 50.36, 34.14, 51.98, 38.44),
    ("deepseek", "none", "moee_concat"): (46.26, 55.88, 37.90, 42.37, 54.19, 41.20, 53.66, 43.06),
    ("deepseek", "none", "moee_sum"): (46.41, 60.58, 41.50, 42.85, 54.98, 42.33, 53.70, 44.36),
    ("deepseek", "prompteol", "hs"): (51.99, 69.56, 54.68, 58.04, 68.47, 45.29, 63.78, 65.48),
    ("deepseek", "prompteol", "rw"): (61.97, 65.86, 51.38, 65.86, 62.49, 53.97, 57.93, 56.68),
    ("deepseek", "prompteol", "moee_concat"): (66.79, 77.60, 63.56, 64.60, 71.22, 61.96, 66.29, 68.72),
    ("deepseek", "prompteol", "moee_sum"): (67.39, 81.43, 68.98, 67.76, 74.26, 62.09, 69.98, 73.41),
    ("qwen", "none", "hs"): (8.39, 25.23, 15.76, 22.08, 38.11, 28.69, 51.73, 36.88),
    ("qwen", "none", "rw"): (27.96, 18.89, 13.88, 17.11, 36.29, 25.40, 29.42, 22.80),
    ("qwen", "none", "moee_concat"): (33.36, 36.30, 24.68, 25.86, 47.16, 39.06, 53.92, 43.09),
    ("qwen", "none", "moee_sum"): (35.72, 47.29, 31.51, 31.00, 50.61, 53.40, 62.35, 54.11),
    ("qwen", "prompteol", "hs"): (55.05, 77.48, 63.63, 73.60, 73.49, 61.42, 67.01, 67.42),
    ("qwen", "prompteol", "rw"): (54.39, 59.05, 45.49, 48.11, 56.96, 43.65, 55.46, 50.54),
    ("qwen", "prompteol", "moee_concat"): (64.44, 77.38, 64.05, 67.18, 71.48, 64.87, 69.01, 69.71),
    ("qwen", "prompteol", "moee_sum"): (65.54, 82.44, 71.39, 72.88, 75.43, 67.84, 71.15, 75.57),
    ("olmoe", "none", "hs"): (21.53, 41.47, 22.71, 39.88, 51.49, 44.11, 39.98, 22.36),
    ("olmoe", "none", "rw"): (47.16, 43.92, 32.62, 43.87, 51.91, 44.30, 52.89, 40.77),
    ("olmoe", "none", "moee_concat"): (48.82, 52.69, 37.48, 46.80, 56.06, 54.58, 52.24, 42.02),
    ("olmoe", "none", "moee_sum"): (49.59, 54.19, 38.87, 47.27, 56.11, 54.58, 52.82, 42.16),
    ("olmoe", "prompteol", "hs"): (65.51, 81.86, 69.37, 77.64, 77.19, 73.54, 66.62, 71.51),
    ("olmoe", "prompteol", "rw"): (55.76, 60.01, 48.08, 49.88, 57.88, 56.28, 56.02, 50.72),
    ("olmoe", "prompteol", "moee_concat"): (67.35, 80.13, 68.42, 68.76, 73.35, 73.02, 67.51, 70.47),
    ("olmoe", "prompteol", "moee_sum"): (68.84, 84.34, 74.02, 73.81, 76.88, 73.02, 70.56, 75.58),
}
_OTHER_ROWS: dict[tuple[str, str, str], tuple[float, ...]] = {
    ("deepseek", "none", "hs"): (49.14, 27.55, 57.69, 49.04, 39.63, 25.62, 26.11, 43.75, 45.23, 25.79),
    ("deepseek", "none", "rw"): (52.37, 26.49, 53.32, 53.39, 47.79, 15.33, 19.72, 41.97, 42.65, 23.21),
    ("deepseek", "none", "moee_concat"): (
        52.64,
        28.02,
        54.12,
        57.27,
        46.48,
        22.94,
        25.35,
        44.10,
        53.43,
        26.06,
    ),
    ("deepseek", "none", "moee_sum"): (50.32, 27.52, 68.39, 58.99, 45.25, 31.44, 34.22, 45.26, 70.79, 27.58),
    ("deepseek", "prompteol", "hs"): (60.13, 49.11, 65.47, 36.72, 60.79, 27.02, 22.26, 43.75, 45.23, 25.41),
    ("deepseek", "prompteol", "rw"): (57.68, 35.57, 55.32, 76.58, 60.01, 21.89, 18.04, 46.57, 42.65, 23.21),
    ("deepseek", "prompteol", "moee_concat"): (
        61.12,
        45.59,
        55.93,
        80.08,
        64.79,
        29.13,
        23.06,
        50.66,
        72.63,
        36.65,
    ),
    ("deepseek", "prompteol", "moee_sum"): (
        59.32,
        46.86,
        68.76,
        79.20,
        62.70,
        35.77,
        33.27,
        52.93,
        76.17,
        38.88,
    ),
    ("qwen", "none", "hs"): (48.83, 31.02, 59.38, 45.71, 43.14, 26.14, 22.48, 43.71, 60.91, 30.12),
    ("qwen", "none", "rw"): (42.80, 20.63, 53.53, 48.78, 35.74, 9.71, 11.38, 41.00, 36.85, 22.75),
    ("qwen", "none", "moee_concat"): (49.60, 30.93, 53.90, 53.74, 45.83, 28.99, 24.51, 44.95, 68.42, 34.31),
    ("qwen", "none", "moee_sum"): (48.84, 32.76, 70.50, 57.78, 45.95, 32.07, 30.62, 44.30, 70.85, 34.31),
    ("qwen", "prompteol", "hs"): (61.14, 48.09, 68.80, 82.50, 66.07, 34.04, 24.95, 54.69, 75.06, 39.79),
    ("qwen", "prompteol", "rw"): (55.33, 33.82, 54.37, 73.72, 55.98, 16.94, 16.54, 44.65, 55.03, 30.96),
    ("qwen", "prompteol", "moee_concat"): (
        60.78,
        46.10,
        55.82,
        82.34,
        65.51,
        30.45,
        23.91,
        52.15,
        75.69,
        40.51,
    ),
    ("qwen", "prompteol", "moee_sum"): (60.72, 47.97, 70.03, 80.21, 64.20, 42.05, 34.60, 51.30, 74.53, 42.91),
    ("olmoe", "none", "hs"): (50.29, 30.29, 52.10, 55.07, 40.04, 21.05, 26.52, 43.67, 69.08, 24.05),
    ("olmoe", "none", "rw"): (50.15, 25.53, 54.93, 54.25, 51.99, 17.14, 18.17, 42.83, 54.17, 25.72),
    ("olmoe", "none", "moee_concat"): (51.59, 28.76, 53.51, 56.97, 46.31, 20.72, 24.94, 43.91, 70.33, 25.49),
    ("olmoe", "none", "moee_sum"): (51.00, 29.75, 64.86, 57.03, 44.82, 27.58, 33.75, 44.57, 72.54, 26.20),
    ("olmoe", "prompteol", "hs"): (59.58, 47.50, 67.46, 82.32, 61.87, 38.96, 26.69, 55.32, 78.24, 41.36),
    ("olmoe", "prompteol", "rw"): (52.79, 28.51, 53.75, 70.37, 52.79, 22.13, 17.72, 45.11, 55.43, 31.20),
    ("olmoe", "prompteol", "moee_concat"): (
        59.72,
        42.78,
        55.27,
        82.32,
        61.38,
        41.23,
        26.60,
        52.81,
        77.14,
        40.13,
    ),
    ("olmoe", "prompteol", "moee_sum"): (
        59.92,
        45.63,
        66.84,
        80.98,
        61.53,
        38.58,
        34.33,
        56.68,
        81.19,
        43.41,
    ),
}

#: Trained baselines of the paper's PromptEOL table (family averages and Avg, same order).
PAPER_BASELINES: dict[str, tuple[float, ...]] = {
    "GloVe": (51.04, 23.11, 62.90, 48.72, 60.52, 28.87, 45.86),
    "BERT": (52.36, 23.48, 66.10, 48.47, 52.89, 29.82, 45.52),
    "SimCSE-unsup": (54.80, 22.59, 70.79, 52.42, 75.00, 31.15, 51.13),
    "SimCSE-sup": (58.98, 29.49, 75.82, 53.61, 79.97, 23.31, 53.53),
    "coCondenser": (53.89, 32.85, 74.56, 60.08, 76.41, 29.50, 54.55),
}

_STS_ORDER = ("STS12", "STS13", "STS14", "STS15", "STS16", "BIOSSES", "SICK-R", "STSBenchmark")
_OTHER_ORDER = (
    "TweetSentimentExtractionClassification",
    "EmotionClassification",
    "ToxicConversationsClassification",
    "TwitterURLCorpus",
    "TwitterSemEval2015",
    "TwentyNewsgroupsClustering",
    "MedrxivClusteringS2S",
    "AskUbuntuDupQuestions",
    "SciDocsRR",
    "StackOverflowDupQuestions",
)


def paper_task_names() -> list[str]:
    """The 19 task names in family order."""
    return [name for family in FAMILIES for name in PAPER_TASKS[family]]


def task_family(task_name: str) -> str | None:
    """The paper family of one of its tasks, or ``None`` for a task outside the suite."""
    for family, names in PAPER_TASKS.items():
        if task_name in names:
            return family
    return None


def paper_model_key(model_name: str) -> str | None:
    """Map a model name (HF id, path or key) to the paper's key, or ``None`` if not a paper model.

    Matching is on the last path component, case-insensitively, so a local copy of
    ``allenai/OLMoE-1B-7B-0924`` at ``/models/OLMoE-1B-7B-0924`` is recognised too.
    """
    tail = model_name.rstrip("/").split("/")[-1].lower()
    for hf_id, key in PAPER_MODELS.items():
        if tail in (hf_id.split("/")[-1].lower(), key):
            return key
    return None


def paper_scores(model_key: str, prompt: str, method: str) -> dict[str, object] | None:
    """The paper's published numbers for one row, or ``None`` if the paper has no such row.

    Returns ``{"families": {family: score}, "avg": float, "tasks": {task: score}}`` with
    scores in percent, as printed in the paper. ``SummEval``'s task score is the family value.
    """
    key = (model_key, prompt, method)
    if key not in _FAMILY_ROWS:
        return None
    fam = _FAMILY_ROWS[key]
    tasks = dict(zip(_STS_ORDER, _STS_ROWS[key]))
    tasks.update(zip(_OTHER_ORDER, _OTHER_ROWS[key]))
    tasks["SummEval"] = fam[5]
    return {"families": dict(zip(FAMILIES, fam[:6])), "avg": fam[6], "tasks": tasks}
