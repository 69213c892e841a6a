"""hfpatch.save_pretrained writes a README.md model card: Hub front matter (library_name, hfpatch's tags, the base
model when known), the patch, the windows and how to load it; a card the user wrote keeps its text and front matter
keys, and hfpatch's section between its markers is replaced on the next save, never duplicated. `hfpatch card DIR
--results RUN...` adds the tables and plots of evaluation runs in a section of their own, replaced by the next."""

from __future__ import annotations

import errno
import os
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
    # a model loaded from a folder names it as its base model (by the folder's name: test_a_card_names_...)
    hfpatch.save_pretrained(hfpatch.from_pretrained(tmp_path / "yarn"), tmp_path / "again")
    assert "- Base model: `yarn`" in (tmp_path / "again" / "README.md").read_text()


def test_a_card_names_a_local_base_model_by_its_folder_name_never_its_path(tmp_path):
    """A card is published: a model loaded from /home/me/runs/base is `base` in it, and not the Hub's base_model (a
    hub id); a model loaded by hub id is named by it, there too."""
    folder = tmp_path / "runs" / "base"
    hfpatch.save_pretrained(tiny.build_tiny("llama"), folder)
    hfpatch.save_pretrained(hfpatch.patch(hfpatch.from_pretrained(folder), position="yarn", factor=2.0),
                            tmp_path / "yarn")
    card = (tmp_path / "yarn" / "README.md").read_text()
    assert str(tmp_path) not in card and "base_model" not in _front(card)
    assert "- Base model: `base`" in card
    hub = hfpatch.patch(tiny.build_tiny("llama"), position="yarn", factor=2.0)
    hub.config.name_or_path = "HuggingFaceTB/SmolLM2-135M"  # as from_pretrained of that hub id leaves it
    hfpatch.save_pretrained(hub, tmp_path / "hub")
    card = (tmp_path / "hub" / "README.md").read_text()
    assert _front(card)["base_model"] == "HuggingFaceTB/SmolLM2-135M"
    assert "- Base model: `HuggingFaceTB/SmolLM2-135M`" in card


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
    """A tiny model patched and saved by `hfpatch patch --out`, two perplexity runs of it (one drew its plot), and a
    run of the model it was patched from ("other")."""
    root = tmp_path_factory.mktemp("card")
    base = tiny.save_sized(root / "base")
    assert main(["patch", str(base), "--position", "yarn", "--factor", "2", "--out", str(root / "yarn")]) == 0
    text = root / "text.txt"
    text.write_text(stdlib_text(20_000))
    common = ["--model", str(root / "yarn"), "--text-files", str(text), "--tokens-per-doc", "128"]
    assert evaluation("ppl").main([*common, "--lengths", "64", "--patches", "none", "--out", str(root / "short")]) == 0
    assert evaluation("ppl").main([*common, "--lengths", "32,128", "--patches", "none", "--no-plot",
                                   "--out", str(root / "long")]) == 0
    common[1] = str(base)
    assert evaluation("ppl").main([*common, "--lengths", "64", "--patches", "none", "--no-plot",
                                   "--out", str(root / "other")]) == 0
    return root


def _table(run: Path, model: Path) -> str:
    """The run's table.md, the model named by its folder's name (as a card names it)."""
    return (run / "table.md").read_text().strip().replace(str(model), model.name)


@pytest.fixture
def card_dir(saved_and_runs, tmp_path):
    """A copy of the saved folder, with text of the user's own in its card."""
    folder = tmp_path / "model"
    shutil.copytree(saved_and_runs / "yarn", folder)
    readme = folder / "README.md"
    readme.write_text(readme.read_text() + "\n## My notes\n\nTrained on my data.\n")
    return folder


def test_card_adds_the_runs_tables_and_plot_and_a_second_run_replaces_them(saved_and_runs, card_dir, capsys):
    short, long, model = saved_and_runs / "short", saved_and_runs / "long", saved_and_runs / "yarn"
    assert main(["card", str(card_dir), "--results", str(short)]) == 0
    card = (card_dir / "README.md").read_text()
    assert _table(short, model) in card
    link = f"{PLOTS}/short-ppl.png"
    assert f"]({link})" in card and (card_dir / link).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "## My notes\n\nTrained on my data.\n" in card and card.count(CARD_START) == 1
    assert _front(card)["tags"] == ["hfpatch", "yarn"]  # the front matter as the save wrote it

    assert main(["card", str(card_dir), "--results", str(long), str(short)]) == 0
    again = (card_dir / "README.md").read_text()
    assert again.count(RESULTS_START) == 1 and again.count(RESULTS_END) == 1 and again.count("## Evaluations") == 1
    assert _table(long, model) in again and _table(short, model) in again
    assert again.index("### ppl: long") < again.index("### ppl: short")  # in the order given
    assert "## My notes\n\nTrained on my data.\n" in again
    assert sorted(p.name for p in (card_dir / PLOTS).iterdir()) == ["short-ppl.png"]  # long ran with --no-plot


def test_a_later_save_of_the_same_model_keeps_the_evaluations_in_the_card(saved_and_runs, card_dir):
    assert main(["card", str(card_dir), "--results", str(saved_and_runs / "short")]) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: nothing is dropped
        hfpatch.save_pretrained(hfpatch.from_pretrained(card_dir), card_dir)
    card = (card_dir / "README.md").read_text()
    assert "`yarn:2`" in card and card.count(RESULTS_START) == 1 and "### ppl: short" in card
    assert (card_dir / PLOTS / "short-ppl.png").is_file()


def test_a_save_of_another_patch_drops_the_evaluations_of_the_old_one(saved_and_runs, card_dir):
    """The folder re-saved with ntk:4: the yarn:2 evaluations would show under the ntk:4 patch's name. They and their
    plots are removed, with a warning; the user's text stays."""
    assert main(["card", str(card_dir), "--results", str(saved_and_runs / "short")]) == 0
    model = hfpatch.patch(hfpatch.from_pretrained(card_dir), position="ntk", factor=4.0)
    with pytest.warns(UserWarning, match="evaluations .* are of other model files"):
        hfpatch.save_pretrained(model, card_dir)
    card = (card_dir / "README.md").read_text()
    assert "`ntk:4`" in card and RESULTS_START not in card and "## Evaluations" not in card
    assert "## My notes\n\nTrained on my data.\n" in card and not (card_dir / PLOTS).exists()


def test_hfpatch_patch_into_a_carded_folder_drops_the_old_patchs_evaluations(saved_and_runs, card_dir, capsys):
    assert main(["card", str(card_dir), "--results", str(saved_and_runs / "short")]) == 0
    capsys.readouterr()
    assert main(["patch", str(saved_and_runs / "base"), "--position", "ntk", "--factor", "4", "--out",
                 str(card_dir)]) == 0
    assert "hfpatch: warning: the model card's evaluations" in capsys.readouterr().err
    card = (card_dir / "README.md").read_text()
    assert "`ntk:4`" in card and RESULTS_START not in card and not (card_dir / PLOTS).exists()
    assert "## My notes\n\nTrained on my data.\n" in card  # the card's own text is kept


def test_card_leaves_out_another_models_runs_and_says_which(saved_and_runs, card_dir, capsys):
    """A run of the model the folder was patched from is not of the folder's model: left out, in one line naming
    it and why."""
    capsys.readouterr()
    assert main(["card", str(card_dir), "--results", str(saved_and_runs / "other"), str(saved_and_runs / "short")]) == 0
    warning = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warning) == 1 and str(saved_and_runs / "other") in warning[0] and "config.json" in warning[0]
    card = (card_dir / "README.md").read_text()
    assert "### ppl: short" in card and "### ppl: other" not in card and "base:" not in card


def test_card_names_the_model_by_its_folder_name_never_its_path(saved_and_runs, card_dir, monkeypatch):
    """The tables and the plot's title name the evaluated model `yarn`, not the path it was evaluated at."""
    titles = []
    draw = type(evaluation("ppl")).plot

    def spy(self, data, path, title):
        titles.append(title)
        return draw(self, data, path, title)

    monkeypatch.setattr(type(evaluation("ppl")), "plot", spy)
    assert main(["card", str(card_dir), "--results", str(saved_and_runs / "short")]) == 0
    card = (card_dir / "README.md").read_text()
    assert str(saved_and_runs) not in card and "\nyarn: 1 document(s)" in card
    assert len(titles) == 1 and titles[0].startswith("yarn: ") and str(saved_and_runs) not in titles[0]


def test_card_on_a_folder_it_cannot_write_is_one_line_exit_2(saved_and_runs, card_dir, capsys, monkeypatch):
    """A read-only folder (simulated: the tests run as root, whom permissions do not stop)."""
    before = _snapshot(card_dir)

    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)
    capsys.readouterr()
    assert main(["card", str(card_dir), "--results", str(saved_and_runs / "short")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("hfpatch: error:") and "Read-only file system" in err, err
    assert _snapshot(card_dir) == before


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("case, message", [
    ("no card", "has no model card (README.md)"),
    ("not hfpatch's", "has no hfpatch section"),
    ("not a folder", "is not a folder"),
    ("no results.json", "no results.json there"),
    ("unfinished run", "no table.md there"),
    ("another results file", "not one hfpatch eval writes"),
    ("only another model's runs", "none of the runs evaluated the model in"),
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
    elif case == "only another model's runs":
        shutil.rmtree(run)
        shutil.copytree(saved_and_runs / "other", run)
    else:
        (run / "table.md").unlink()
    before = _snapshot(card_dir)
    capsys.readouterr()
    runs = [str(run)] if case == "only another model's runs" else [str(saved_and_runs / "long"), str(run)]
    assert main(["card", str(folder), "--results", *runs]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("hfpatch: error:") and message in err
    assert _snapshot(card_dir) == before


def test_card_interrupted_while_drawing_plots_leaves_the_folder_as_it_was(saved_and_runs, card_dir, monkeypatch):
    assert main(["card", str(card_dir), "--results", str(saved_and_runs / "short")]) == 0
    before = _snapshot(card_dir)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(card_module.Run, "draw", interrupted)
    with pytest.raises(KeyboardInterrupt):
        main(["card", str(card_dir), "--results", str(saved_and_runs / "long"), str(saved_and_runs / "short")])
    assert _snapshot(card_dir) == before
    assert sorted(p.name for p in card_dir.iterdir()) == sorted({*before, PLOTS} - {f"{PLOTS}/short-ppl.png"})
