"""eval.docs_tables: the documentation's result tables are made from the committed results files, and --check
catches a generated file that differs from them (edited by hand, or stale after a results file changed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval import docs_tables as tables_module

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def docs_tables(tmp_path, monkeypatch):
    monkeypatch.setattr(tables_module, "OUT", tmp_path / "generated")
    return tables_module


def test_the_committed_tables_are_what_the_results_files_give(docs_tables, monkeypatch):
    monkeypatch.setattr(docs_tables, "OUT", ROOT / "docs" / "generated")
    assert docs_tables.main(["--check"]) == 0


def test_check_names_a_table_edited_by_hand(docs_tables, capsys):
    assert docs_tables.main([]) == 0
    table = docs_tables.OUT / "main_ppl.md"
    table.write_text(table.read_text().replace("| none |", "| none (edited) |"))
    assert docs_tables.main(["--check"]) == 1
    assert "docs/generated/main_ppl.md: differs" in capsys.readouterr().err


def test_check_names_a_table_made_stale_by_its_results_file(docs_tables, tmp_path, monkeypatch, capsys):
    assert docs_tables.main([]) == 0
    results = tmp_path / "results"
    results.mkdir()
    data = json.loads((docs_tables.RESULTS / "main.json").read_text())
    data["cells"][0]["ppl"] *= 2  # a re-run that changed one number
    (results / "main.json").write_text(json.dumps(data))
    original = docs_tables.load
    monkeypatch.setattr(docs_tables, "load", lambda p: json.loads((results / p).read_text()) if p == "main.json"
                        else original(p))
    assert docs_tables.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "main_ppl.md: differs" in err and "books_ppl.md" not in err


def test_check_names_a_file_no_table_makes(docs_tables, capsys):
    assert docs_tables.main([]) == 0
    (docs_tables.OUT / "typed_by_hand.md").write_text("| a |\n|---|\n| 1 |\n")
    assert docs_tables.main(["--check"]) == 1
    assert "typed_by_hand.md: not made by eval/docs_tables.py" in capsys.readouterr().err
