"""The recipe x method table (moee/evaluation/recipe_tables.py) on a document with known numbers."""

from __future__ import annotations

from moee.evaluation.recipe_tables import build_recipe_table, recipe_markdown


def _system(avg, method=None, **settings):
    s = {"method": method, "pooling": "last", "prompt": "prompteol", "score": "native", **settings}
    return {"label": "x", "settings": s if method else {}, "avg": avg, "retrieval": avg / 2}


def test_rows_columns_reading_and_paper_row():
    doc = {
        "systems": [
            _system(30.0, "hs"),
            _system(20.0, "rw"),
            _system(31.0, "moee_sum", alpha="auto"),
            _system(29.0, "hs", recipe="echo"),
            _system(25.0, "rw", recipe="echo"),
            _system(24.0, "moee_sum", recipe="echo", alpha="auto"),
            _system(28.0, "moee_sum", score="softmax", alpha="auto"),
            {"label": "all-MiniLM-L6-v2", "settings": {}, "avg": 60.0, "retrieval": 70.0},
        ]
    }
    table = build_recipe_table(doc)
    labels = [r["label"] for r in table["rows"]]
    assert labels[0] == "PromptEOL" and len(labels) == 3  # plain rows first, one per variant
    echo = next(r for r in table["rows"] if r["variant"].get("recipe") == "echo")
    assert echo["avg"] == {"hs": 29.0, "rw": 25.0, "moee_sum": 24.0}
    assert [r["paper"] for r in table["rows"]] == [False, True, False]  # PromptEOL + softmax, no recipe
    read = table["reading"]
    assert read["methods"]["rw"]["helps"] == [{"variant": echo["label"], "gain": 5.0, "versus": "PromptEOL"}]
    assert read["methods"]["hs"]["hurts"][0]["gain"] == -1.0 and not read["methods"]["hs"]["helps"]
    assert [b["variant"] for b in read["moee_sum_beats_both"]] == ["PromptEOL"]  # 31 > 30, 20; echo: 24 < 29
    md = recipe_markdown(table)
    assert "(paper's configuration)" in md and "all-MiniLM-L6-v2 (dense baseline)" in md
    assert "**RW**: best echo" in md.replace("PromptEOL (echo)", "echo")


def test_a_prompt_ensemble_is_judged_against_single_prompt_prompteol():
    """A plain ensemble (the nine stability prompts, or a list of prompts) is a variant like any
    recipe: its gain is read against single-prompt PromptEOL of the same score and pooling."""
    doc = {
        "systems": [
            _system(42.29, "hs"),
            _system(40.06, "hs", prompt="stability"),
            _system(43.0, "hs", prompt="prompteol+meaning"),
            _system(50.0, "hs", pooling="mean"),
            _system(41.0, "hs", prompt="stability", pooling="mean"),
            _system(39.0, "hs", prompt="none"),
        ]
    }
    read = build_recipe_table(doc)["reading"]["methods"]["hs"]
    gains = {(g["variant"], g["versus"]): g["gain"] for g in read["helps"] + read["hurts"]}
    stability = next(v for v, _ in gains if v.startswith("prompt stability") and "mean" not in v)
    assert gains[(stability, "PromptEOL")] == -2.23
    assert gains[(stability + " (pooling=mean)", "PromptEOL (pooling=mean)")] == -9.0
    assert any(b == "PromptEOL" and g == 0.71 for (_, b), g in gains.items())  # prompteol+meaning
    assert len(gains) == 3  # single prompts (PromptEOL, no prompt, mean pooling) are bases, not variants
    md = recipe_markdown(build_recipe_table(doc))
    assert "hurts most: " in md and "-9.00 vs PromptEOL (pooling=mean)" in md


def test_rows_differing_only_by_pooling_are_distinct_rows():
    doc = {
        "systems": [
            _system(30.0, "hs"),
            _system(35.0, "hs", pooling="mean"),
            _system(31.0, "hs", recipe="echo"),
            _system(33.0, "hs", recipe="echo", pooling="mean"),
        ]
    }
    table = build_recipe_table(doc)
    rows = {(r["variant"]["pooling"], r["variant"].get("recipe")): r for r in table["rows"]}
    assert len(table["rows"]) == 4 and len({r["label"] for r in table["rows"]}) == 4
    assert rows[("last", None)]["avg"] == {"hs": 30.0} and rows[("mean", None)]["avg"] == {"hs": 35.0}
    gains = {g["variant"]: (g["gain"], g["versus"]) for g in table["reading"]["methods"]["hs"]["hurts"]}
    assert gains[rows[("mean", "echo")]["label"]] == (-2.0, rows[("mean", None)]["label"])
