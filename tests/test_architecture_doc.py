"""docs/design/architecture.md's layout lists every module of the package, and names none that does not exist: a
module added, moved or removed without the design doc saying so fails here."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "design" / "architecture.md"


def layout_lines() -> list[str]:
    text = DOC.read_text()
    section = text[text.index("## Layout"):]
    block = section[section.index("```") + 3:]
    return block[: block.index("```")].splitlines()


def modules() -> list[Path]:
    return sorted(p.relative_to(REPO) for p in (REPO / "hfpatch").rglob("*.py")
                  if "__pycache__" not in p.parts and (p.name != "__init__.py" or is_module_in_disguise(p)))


def is_module_in_disguise(init: Path) -> bool:
    """A package's __init__.py that holds a module's worth of code (over 100 lines), not only its docstring and
    re-exports: listed like any module."""
    return len(init.read_text().splitlines()) > 100


def listed(path: Path, lines: list[str]) -> bool:
    """The module's path is on a line, or its file name is on a line that names its folder ("folder/a.py, b.py")."""
    folder = path.parent.as_posix() + "/"
    return any(path.as_posix() in line or (folder in line and re.search(rf"\b{re.escape(path.name)}\b", line))
               for line in lines)


def test_the_layout_lists_every_module_of_the_package():
    lines = layout_lines()
    missing = [p.as_posix() for p in modules() if not listed(p, lines)]
    assert not missing, f"docs/design/architecture.md's layout leaves out: {', '.join(missing)}"


def test_the_layout_names_no_module_that_does_not_exist():
    named = {m for line in layout_lines() for m in re.findall(r"hfpatch/[\w/]+\.py", line)}
    gone = sorted(m for m in named if not (REPO / m).exists())
    assert not gone, f"docs/design/architecture.md's layout names modules that do not exist: {', '.join(gone)}"
