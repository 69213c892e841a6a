"""eval.docs_tables: the documentation's result tables are made from the committed results files, and --check
catches a generated file that differs from them (edited by hand, or stale after a results file changed)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from eval import docs_tables as tables_module

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def docs_tables(tmp_path, monkeypatch):
    monkeypatch.setattr(tables_module, "OUT", tmp_path / "generated")
    readme = tmp_path / "README.md"  # main() writes README.md's generated passages too: a copy of it
    readme.write_text((ROOT / "README.md").read_text())
    monkeypatch.setattr(tables_module, "README", readme)
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


def test_check_names_a_readme_passage_edited_by_hand_and_a_run_writes_it_back(docs_tables, capsys):
    committed = docs_tables.README.read_text()
    row = next(line for line in committed.splitlines() if line.startswith('| `placement="pre"`'))
    docs_tables.README.write_text(committed.replace(row, row.rsplit("|", 2)[0] + "| 1 / 2 / 3 / 4 |"))
    assert docs_tables.main(["--check"]) == 1
    assert "README.md: a generated passage differs" in capsys.readouterr().err
    assert docs_tables.main([]) == 0
    assert docs_tables.README.read_text() == committed


def test_a_readme_passage_without_its_markers_is_named(docs_tables):
    start, _ = docs_tables.passage_marks("readme_tests")
    docs_tables.README.write_text(docs_tables.README.read_text().replace(start, ""))
    with pytest.raises(SystemExit, match=r"README\.md: the passage readme_tests must be marked once"):
        docs_tables.main(["--check"])


def scheme_counts() -> dict[str, int]:
    """The docs' generated list of counts (hfpatch.families.counts), read back: {"alibi": 146, "placement=pre": 89,
    "logn": 160, ...}; per-layer positions left out (their names are schemes' names too)."""
    lines = (ROOT / "docs" / "generated" / "supported_counts.md").read_text().splitlines()
    return {name: int(n) for line in lines if line.startswith("- ") and "per-layer" not in line
            for name, n in re.findall(r"([\w=-]+): (\d+)", line)}


@pytest.mark.parametrize(("row", "names"), [
    ('`placement="pre"`', ["placement=pre", "placement=post", "placement=peri", "placement=mix"]),
    ("`alibi`", ["alibi", "t5", "xl"]), ("`nope`", ["nope", "sinusoidal"]),
    ("`learned`", ["learned", "interpolate"]), ("`self-extend`", ["self-extend", "dual-chunk"]),
    ('`attention_temperature="logn"`', ["logn", "llama4"]),
    ('`norm="rmsnorm"`', ["norm=rmsnorm", "norm=layernorm", "norm=batchnorm", "norm=dyt"]),
])
def test_the_readme_table_of_what_applies_says_what_the_docs_counts_say(row, names):
    """Counted twice, by the README's table and by hfpatch.families.counts (the docs' list): the same numbers."""
    line = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith(f"| {row}"))
    numbers = [int(n) for n in line.rstrip(" |").rsplit("|", 1)[1].split("/")]
    counts = scheme_counts()
    assert numbers * (len(names) if len(numbers) == 1 else 1) == [counts[name] for name in names]


def test_test_counts_and_suite_times_are_written_only_by_the_generator():
    """README.md (outside its generated passages) and the docs' pages hold no count of tests run, passed or skipped:
    those come from eval/results/first_hour.json."""
    readme = re.sub(r"<!-- generated by eval/docs_tables.py \((\w+)\).*?<!-- end of \1 -->", "",
                    (ROOT / "README.md").read_text(), flags=re.S)
    pages = {"README.md": readme} | {str(p.relative_to(ROOT)): p.read_text() for p in (ROOT / "docs").rglob("*.md")
                                     if "generated" not in p.parts and p.name != "changelog.md"}
    claims = [f"{name}: {m.group(0)}" for name, text in pages.items()
              for m in re.finditer(r"\b\d{1,3}(?:,\d{3})* (?:tests?|passed|skipped)\b|tests are skipped", text)]
    assert claims == []


def test_the_layer_table_is_the_layering_tests_own():
    """docs/extending.md's table of layers is made from tests/test_layering.py's LAYERS, read without importing it:
    every row, in its order, with what it may import."""
    from test_layering import LAYERS

    declared = tables_module.declared_layers()
    assert declared == LAYERS and list(declared) == list(LAYERS)
    rows = [line for line in tables_module.TABLES["layers"]().splitlines() if line.startswith("| `")]
    assert [row.split("`")[1].rstrip("/") for row in rows] == list(LAYERS)
