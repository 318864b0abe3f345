"""The report page as a reader sees it: expert contexts keep the tokenizer's spacing, no title or
label of a figure runs into another axes, the page's stages report progress, and a saturation
series that tokenises differently from the model says so."""

import numpy as np
import pytest
from test_analysis_specialization_page import make_report

from moee.analysis.specialization import BaselineDraws, SpecializationAccumulator, render_html
from moee.analysis.specialization.sections.experts import context_pieces

VOCAB = ["the", "user", "##s", "product", "[SEP]"]


def wordpiece_decode(ids):
    """WordPiece's decoding: words apart, ``##`` pieces glued to the word before."""
    text = ""
    for i in ids:
        piece = VOCAB[i]
        text += piece[2:] if piece.startswith("##") else (" " if text else "") + piece
    return text


def test_contexts_keep_the_spaces_the_tokenizer_writes():
    """``the users product`` with the routed token ``user``: the page shows ``the user|s product``,
    not ``theuserproduct`` (each part decoded apart and run together)."""
    assert context_pieces(wordpiece_decode, [0], 1, [2, 3]) == ("the", " user", "s product")
    assert context_pieces(wordpiece_decode, [], 0, [1]) == ("", "the", " user")
    assert context_pieces(wordpiece_decode, [0, 1], 2, []) == ("the user", "s", "")
    acc = SpecializationAccumulator(1, 2, 1, n_contexts=1, context_window=2)
    probs = np.array([[[0.5, 0.5]], [[0.1, 0.9]], [[0.6, 0.4]], [[0.7, 0.3]]])
    acc.update(np.array([0, 1, 2, 3]), probs, text_index=0)
    rep = acc.result(wordpiece_decode, min_token_count=1)
    (ctx,) = rep["experts"][0][1]["top_contexts"]
    assert (ctx["left"], ctx["token"], ctx["right"]) == ("the", " user", "s product")
    assert ctx["left"] + ctx["token"] + ctx["right"] == wordpiece_decode([0, 1, 2, 3])


def test_contexts_fall_back_to_word_spacing_where_prefixes_do_not_line_up():
    def decode(ids):  # a decoder that ends every text with a mark: no decoding is a prefix of another
        return " ".join(VOCAB[i] for i in ids) + "!"

    assert context_pieces(decode, [0], 1, [3]) == ("the!", " user!", " product!")


def _figures(monkeypatch, report):
    """Every figure of the page as ``(title, title box, tight box)`` of each of its axes."""
    import moee.analysis.specialization.markup as markup

    figures, png = [], markup._png

    def keep(fig):
        fig.canvas.draw()
        figures.append(
            [
                (ax.get_title(), ax.title.get_window_extent(), ax.get_tightbbox())
                for ax in fig.axes
                if ax.get_visible() and ax.axison and not hasattr(ax, "_colorbar")
            ]
        )
        return png(fig)

    monkeypatch.setattr(markup, "_png", keep)
    render_html(report)
    return figures


@pytest.mark.slow
def test_no_title_of_a_figure_overlaps_another_axes(monkeypatch):
    """Every figure of a page of 8 layers (grids of several rows): no axes' title overlaps another
    axes' box (its tick labels and labels included), as the rows of per-layer grids did when laid
    out without constrained layout."""
    rng = np.random.default_rng(0)
    L, E, k = 8, 16, 2
    acc = SpecializationAccumulator(L, E, k, draws=BaselineDraws(permutations=1))
    for i in range(40):
        ids = rng.integers(0, 30, 20)
        p = rng.dirichlet(np.ones(E), size=(20, L))
        acc.update(ids, p, text_index=i, domain=f"domain {i % 9}", predicted=ids)
    report = acc.result(min_token_count=1)
    report["meta"] = {"command": "moee report"}
    figures = _figures(monkeypatch, report)
    assert len(figures) >= 10 and sum(len(axes) > 4 for axes in figures) >= 2  # multi-row grids
    for axes in figures:
        for i, (title, box, _) in enumerate(axes):
            for j, (_, _, other) in enumerate(axes):
                if title and i != j:
                    width = min(box.x1, other.x1) - max(box.x0, other.x0)
                    height = min(box.y1, other.y1) - max(box.y0, other.y0)
                    assert min(width, height) <= 0, f"the title {title!r} overlaps another axes"


@pytest.mark.slow
def test_the_page_reports_each_stage_on_stderr(capsys):
    report = make_report()
    render_html(report, progress=True)
    err = capsys.readouterr().err
    assert "page" in err and "coactivation" in err and "layer_agreement" in err
    render_html(report)
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_statistics_and_writing_report_progress(tmp_path, capsys):
    from moee.analysis.specialization import write_report

    report = make_report()
    write_report(report, tmp_path / "out", progress=True)
    assert "writing" in capsys.readouterr().err
    acc = SpecializationAccumulator(1, 2, 1)
    acc.update(np.array([0, 1]), np.array([[[0.6, 0.4]], [[0.3, 0.7]]]), text_index=0)
    acc.result(progress=True, min_token_count=1)
    err = capsys.readouterr().err
    assert "statistics" in err and "vocabulary" in err


@pytest.mark.slow
def test_a_saturation_series_of_another_tokenizer_is_marked(tmp_path):
    """Checkpoints whose tokenizer differs from the model's: the section records it and the page
    says it; the same tokenizer gives no such note."""
    pytest.importorskip("torch")
    from moee.analysis.specialization import ReportedModel, same_tokenization, saturation_section
    from moee.capture.tiny import tiny_model, tiny_tokenizer
    from moee.embed.embedder import MoEEmbedder

    tok = tiny_tokenizer()
    other = tiny_tokenizer()
    vocab = other.get_vocab()
    assert same_tokenization(tok, other, ["the cat sat"])
    models = {str(s): MoEEmbedder(tiny_model("olmoe", n_layers=2, seed=s), tok) for s in (1, 2)}
    texts = ["the cat sat on the mat", "a dog ran up the hill"]

    class Shifted:  # another tokenizer: every id moved by one
        def __call__(self, text):
            return {"input_ids": [(i + 1) % len(vocab) for i in tok(text)["input_ids"]]}

    kw = dict(top_k=2, load=models.__getitem__, progress=False)
    same = saturation_section(["1", "2"], texts, model=ReportedModel("<m>", tok), **kw)
    assert same["tokenization"]["same_as_model"] is True
    differs = saturation_section(["1", "2"], texts, model=ReportedModel("<m>", Shifted()), **kw)
    assert differs["tokenization"] == {
        "same_as_model": False,
        "model": "<m>",
        "reason": "the checkpoints tokenise the first 2 texts differently from <m>",
    }
    report = make_report()
    report["saturation"] = differs
    page = render_html(report)
    assert "tokenise the corpus differently from the model this page describes (&lt;m&gt;)" in page
    report["saturation"] = same
    assert "tokenise the corpus differently" not in render_html(report)
