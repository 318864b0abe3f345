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
