"""hfpatch.save_pretrained writes a README.md model card: Hub front matter (library_name, hfpatch's tags, the base
model when known), the patch, the windows and how to load it; a card the user wrote keeps its text and front matter
keys, and hfpatch's section between its markers is replaced on the next save, never duplicated. `hfpatch card DIR
--results RUN...` adds the tables and plots of evaluation runs in a section of their own, replaced by the next."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import yaml
from conftest import stdlib_text

import hfpatch
from hfpatch import tiny
from hfpatch.cli import main
from hfpatch.evaluate import card as card_module
from hfpatch.evaluate import evaluation
from hfpatch.evaluate.card import PLOTS, RESULTS_END, RESULTS_START
from hfpatch.interop.io import CARD_END, CARD_START


def _front(text: str) -> dict:
    return yaml.safe_load(text.split("---\n")[1])


def test_a_saved_model_has_a_card_saying_how_to_load_it(tmp_path):
    native = hfpatch.patch(tiny.build_tiny("llama"), position="yarn", factor=2.0)
    hfpatch.save_pretrained(native, tmp_path / "yarn")
    card = (tmp_path / "yarn" / "README.md").read_text()
    assert _front(card) == {"library_name": "transformers", "tags": ["hfpatch", "yarn"]}
    assert "`yarn:2`" in card and f"Trained window: {tiny.WINDOW} tokens; extended window: {2 * tiny.WINDOW}" in card
    assert "AutoModelForCausalLM.from_pretrained" in card
    alibi = hfpatch.patch(tiny.build_tiny("llama"), position="alibi")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hfpatch.save_pretrained(alibi, tmp_path / "alibi")
    card = (tmp_path / "alibi" / "README.md").read_text()
    assert "hfpatch.from_pretrained(" in card and "alibi" in _front(card)["tags"]
    # a model loaded from a folder names it as its base model
    hfpatch.save_pretrained(hfpatch.from_pretrained(tmp_path / "yarn"), tmp_path / "again")
    assert _front((tmp_path / "again" / "README.md").read_text())["base_model"] == str(tmp_path / "yarn")


def test_a_card_the_user_wrote_is_kept_and_the_hfpatch_section_replaced(tmp_path):
    (tmp_path / "README.md").write_text("---\nlicense: apache-2.0\ntags:\n- mine\n---\n# My model\n\nMy words.\n")
    model = hfpatch.patch(tiny.build_tiny("llama"), position="yarn", factor=2.0)
    hfpatch.save_pretrained(model, tmp_path)
    hfpatch.patch(model, position="ntk", factor=4.0)
    hfpatch.save_pretrained(model, tmp_path)
    card = (tmp_path / "README.md").read_text()
    front = _front(card)
    assert front["license"] == "apache-2.0" and front["tags"][:2] == ["mine", "hfpatch"] and "ntk" in front["tags"]
    assert "# My model\n\nMy words.\n" in card
    assert card.count(CARD_START) == 1 and card.count(CARD_END) == 1
    assert "`ntk:4`" in card and "`yarn:2`" not in card


# ------------------------------------------------------------------------------ hfpatch card DIR --results RUN...


@pytest.fixture(scope="module")
def saved_and_runs(tmp_path_factory):
    """A tiny model patched and saved by `hfpatch patch --out`, and two perplexity runs of it (one drew its plot)."""
    root = tmp_path_factory.mktemp("card")
    base = tiny.save_sized(root / "base")
    assert main(["patch", str(base), "--position", "yarn", "--factor", "2", "--out", str(root / "yarn")]) == 0
    text = root / "text.txt"
    text.write_text(stdlib_text(20_000))
    common = ["--model", str(root / "yarn"), "--text-files", str(text), "--tokens-per-doc", "128"]
    assert evaluation("ppl").main([*common, "--lengths", "64", "--patches", "none", "--out", str(root / "short")]) == 0
    assert evaluation("ppl").main([*common, "--lengths", "32,128", "--patches", "none", "--no-plot",
                                   "--out", str(root / "long")]) == 0
    return root


@pytest.fixture
def card_dir(saved_and_runs, tmp_path):
    """A copy of the saved folder, with text of the user's own in its card."""
    folder = tmp_path / "model"
    shutil.copytree(saved_and_runs / "yarn", folder)
    readme = folder / "README.md"
    readme.write_text(readme.read_text() + "\n## My notes\n\nTrained on my data.\n")
    return folder


def test_card_adds_the_runs_tables_and_plot_and_a_second_run_replaces_them(saved_and_runs, card_dir, capsys):
    short, long = saved_and_runs / "short", saved_and_runs / "long"
    assert main(["card", str(card_dir), "--results", str(short)]) == 0
    card = (card_dir / "README.md").read_text()
    assert (short / "table.md").read_text().strip() in card
    link = f"{PLOTS}/short-ppl.png"
    assert f"]({link})" in card and (card_dir / link).read_bytes() == (short / "ppl.png").read_bytes()
    assert "## My notes\n\nTrained on my data.\n" in card and card.count(CARD_START) == 1
    assert _front(card)["tags"] == ["hfpatch", "yarn"]  # the front matter as the save wrote it

    assert main(["card", str(card_dir), "--results", str(long), str(short)]) == 0
    again = (card_dir / "README.md").read_text()
    assert again.count(RESULTS_START) == 1 and again.count(RESULTS_END) == 1 and again.count("## Evaluations") == 1
    assert (long / "table.md").read_text().strip() in again and (short / "table.md").read_text().strip() in again
    assert again.index("### ppl: long") < again.index("### ppl: short")  # in the order given
    assert "## My notes\n\nTrained on my data.\n" in again
    assert sorted(p.name for p in (card_dir / PLOTS).iterdir()) == ["short-ppl.png"]  # long ran with --no-plot


def test_a_later_save_keeps_the_evaluations_in_the_card(saved_and_runs, card_dir):
    assert main(["card", str(card_dir), "--results", str(saved_and_runs / "short")]) == 0
    model = hfpatch.from_pretrained(card_dir)
    hfpatch.patch(model, position="ntk", factor=4.0)
    hfpatch.save_pretrained(model, card_dir)
    card = (card_dir / "README.md").read_text()
    assert "`ntk:4`" in card and card.count(RESULTS_START) == 1 and "### ppl: short" in card


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("case, message", [
    ("no card", "has no model card (README.md)"),
    ("not hfpatch's", "has no hfpatch section"),
    ("not a folder", "is not a folder"),
    ("no results.json", "no results.json there"),
    ("unfinished run", "no table.md there"),
    ("another results file", "not one hfpatch eval writes"),
])
def test_card_bad_input_is_one_line_exit_2_and_changes_nothing(saved_and_runs, card_dir, tmp_path, capsys, case,
                                                               message):
    folder, run = card_dir, tmp_path / "run"
    shutil.copytree(saved_and_runs / "short", run)
    if case == "no card":
        (folder / "README.md").unlink()
    elif case == "not hfpatch's":
        (folder / "README.md").write_text("# A model someone else saved\n")
    elif case == "not a folder":
        folder = folder / "config.json"
    elif case == "no results.json":
        (run / "results.json").unlink()
    elif case == "another results file":
        (run / "results.json").write_text('{"accuracy": 0.5}')
    else:
        (run / "table.md").unlink()
    before = _snapshot(card_dir)
    capsys.readouterr()
    assert main(["card", str(folder), "--results", str(saved_and_runs / "long"), str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("hfpatch: error:") and message in err
    assert _snapshot(card_dir) == before


def test_card_interrupted_while_copying_plots_leaves_the_folder_as_it_was(saved_and_runs, card_dir, monkeypatch):
    assert main(["card", str(card_dir), "--results", str(saved_and_runs / "short")]) == 0
    before = _snapshot(card_dir)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(card_module.shutil, "copyfile", interrupted)
    with pytest.raises(KeyboardInterrupt):
        main(["card", str(card_dir), "--results", str(saved_and_runs / "long"), str(saved_and_runs / "short")])
    assert _snapshot(card_dir) == before
    assert sorted(p.name for p in card_dir.iterdir()) == sorted({*before, PLOTS} - {f"{PLOTS}/short-ppl.png"})
