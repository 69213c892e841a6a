"""Numbers the docs' prose states beside generated tables, checked against what they describe (the rest come from
results files: eval/docs_tables.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_adapters import REPRODUCED

ROOT = Path(__file__).resolve().parents[1]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                "twelve", "thirteen", "fourteen", "fifteen"]


@pytest.mark.parametrize(("page", "before"), [
    ("docs/index.md", "--8<-- \"docs/generated/supported_counts.md\""),
    ("docs/patching/supported.md", "--8<-- \"docs/generated/supported.md\""),
    ("docs/patching/families.md", "--8<-- \"docs/generated/supported_counts.md\""),
])
def test_the_version_named_beside_the_supported_tables_is_the_one_measured(page, before):
    """The paragraph right above the included table names the transformers version its results file was measured
    on."""
    text = (ROOT / page).read_text()
    paragraph = text[:text.index(before)].rstrip().rsplit("\n\n", 1)[-1]
    measured = json.loads((ROOT / "eval" / "results" / "families" / "supported.json").read_text())["transformers"]
    assert re.findall(r"transformers (\d+\.\d+\.\d+)", paragraph) == [measured]


def test_the_families_inference_reproduces_are_the_ones_the_test_checks():
    text = " ".join((ROOT / "docs" / "patching" / "families.md").read_text().split())
    word, listed = re.search(r"For (\w+) other common families \(([^)]*)\), inference reproduces", text).groups()
    names = [name.strip() for name in listed.split(",")]
    assert sorted(names) == sorted(REPRODUCED) and NUMBER_WORDS.index(word) == len(names)
