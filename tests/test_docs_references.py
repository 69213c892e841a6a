"""Every file, folder and module the documentation names exists. Read: README.md, the pages under docs/ (not
docs/generated/, which eval/docs_tables.py writes and tests/test_docs_tables.py holds), and the docstrings (of
modules, classes and functions) of every module under hfpatch/, recipes/ and eval/. Checked:

- repository paths (`hfpatch/position/registry.py`, `eval/results/`, `docs/extending.md`, `tests/test_x.py`) and
  paths inside the package (`position/rope/builders.py`; in a docstring, also from its own folder or one above,
  `rope/llamacpp.py` in position/): a path whose first folder is one of those places must exist there. A
  placeholder (`evaluations/NAME.py`, `docs/generated/<name>.md`) checks the folder before it; a path after `--out`
  is one a command writes;
- the files a package's docstring lists by bare name (`kinds.py` in norm/): files of that package (or of the folder
  it is in);
- any other bare Python file name (`sweep.py`): a file of that name somewhere in the repository or in Python's
  standard library (the default corpus's documents), unless it is one of OTHER_PROJECTS;
- dotted names (`hfpatch.position.registry`, `hfpatch.evaluate.engines.register`, `python -m eval.docs_tables`): a
  module, found by importlib's path finder without importing anything, and the attribute after it, read off the
  module's source (its top-level names, a class's body, or the names a lazy `__getattr__` serves).

Nothing is imported: the check reads files only.
"""

from __future__ import annotations

import ast
import re
import sysconfig
from dataclasses import dataclass
from importlib.machinery import ModuleSpec, PathFinder
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "hfpatch"
SUFFIXES = {".py", ".md", ".json", ".yaml", ".yml", ".sh", ".txt", ".toml", ".png", ".cfg"}
KEEP_CAPS = {"README", "CHANGELOG", "LICENSE"}  # file names in capitals that are not placeholders
# Bare file names of other projects that docstrings name, and whose they are
OTHER_PROJECTS = {"factory.py": "SGLang", "yarn.py": "SGLang", "rope_variant.py": "SGLang"}
# Dotted names that are not Python names, and the file that holds each as a string
NOT_MODULES = {"hfpatch.record": "hfpatch/interop/gguf.py"}  # the GGUF metadata key of hfpatch's record

PATH = re.compile(r"(?<![\w/.$~:-])(?:[\w.<>*{}-]+/)+[\w.<>*{}-]*")
BARE = re.compile(r"(?<![\w/.$~:<*-])[A-Za-z_][\w-]*\.py\b(?![\w/])")
DOTTED = re.compile(r"(?<![\w/.$-])(?:hfpatch|eval|recipes)(?:\.[A-Za-z_]\w*)+")
WRITTEN = re.compile(r"(?:--out[ =]|> )$")  # what precedes a path a command writes


@dataclass(frozen=True)
class Text:
    where: str  # the file, and for a docstring its line
    text: str
    bases: tuple[Path, ...]  # the folders a path in it may start from
    package: Path | None = None  # the package whose files a package docstring lists by bare name


def docstrings(path: Path) -> list[tuple[int, str, bool]]:
    """(line, docstring, the module's own?) of the module and of every class and function in it."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node, clean=False)
            if text:
                out.append((node.body[0].lineno, text, isinstance(node, ast.Module)))
    return out


def texts() -> list[Text]:
    pages = [REPO / "README.md", *sorted(p for p in (REPO / "docs").rglob("*.md")
                                         if "generated" not in p.relative_to(REPO / "docs").parts)]
    out = [Text(p.relative_to(REPO).as_posix(), p.read_text(), (p.parent, REPO, PACKAGE)) for p in pages]
    for root in ("hfpatch", "recipes", "eval"):
        for path in sorted((REPO / root).rglob("*.py")):
            folders = (path.parent, *(f for f in path.parent.parents if REPO in f.parents), REPO, PACKAGE)
            package = path.parent if path.name == "__init__.py" else None
            for line, text, own in docstrings(path):
                out.append(Text(f"{path.relative_to(REPO).as_posix()}:{line}", text, folders,
                                package if own else None))
    return out


def placeholder(part: str) -> bool:
    stem = part.split(".")[0]
    return any(c in part for c in "<>*{}") or "..." in part or (stem.isupper() and stem not in KEEP_CAPS)


def missing_paths(t: Text) -> list[str]:
    """The paths `t` names, starting from one of its folders, that do not exist."""
    out = []
    for m in PATH.finditer(t.text):
        token = m.group(0).rstrip(".")
        parts = token.rstrip("/").split("/")
        if parts[0] in (".", "..") or WRITTEN.search(t.text[: m.start()]):
            continue  # a link relative to the page (mkdocs checks those), or a path a command writes
        cut = next((i for i, part in enumerate(parts) if placeholder(part)), None)
        if cut is not None:
            parts = parts[:cut]  # the folder before the placeholder
        elif not token.endswith("/") and Path(parts[-1]).suffix not in SUFFIXES:
            continue  # not a file or a folder: "pre/post", "fp16/bf16"
        starts = [base for base in t.bases if parts and (base / parts[0]).is_dir()]
        if starts and not any((base / "/".join(parts)).exists() for base in starts):
            out.append(token)
    return out


def known_files() -> set[str]:
    """The names of the repository's Python files, and of the standard library's (the default corpus's documents)."""
    return ({p.name for root in ("hfpatch", "eval", "recipes", "tests") for p in (REPO / root).rglob("*.py")}
            | {p.name for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py")})


def missing_files(t: Text, everywhere: set[str]) -> list[str]:
    """The bare .py names `t` names that are not files: of its package or the folder it is in (a package's
    docstring), else of the repository or the standard library."""
    out = []
    for m in BARE.finditer(t.text):
        name = m.group(0)
        if placeholder(name) or name in OTHER_PROJECTS:
            continue
        if t.package is not None:
            if not any(t.package.rglob(name)) and not (t.package.parent / name).is_file():
                out.append(name)
        elif name not in everywhere:
            out.append(name)
    return out


def module_spec(name: str) -> ModuleSpec | None:
    """The spec of module `name` under the repository, found without importing it or its packages."""
    spec, search = None, [str(REPO)]
    for part in name.split("."):
        if search is None:  # a module, not a package: it has no sub-modules
            return None
        spec = PathFinder.find_spec(part, list(search))
        if spec is None:
            return None
        search = spec.submodule_search_locations
    return spec


def top_names(body: list[ast.stmt]) -> dict[str, ast.stmt]:
    """The names a module's or class's body binds (definitions, assignments, imports, in conditionals too)."""
    out: dict[str, ast.stmt] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out.update({n.id: node for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)})
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update({(a.asname or a.name).split(".")[0]: node for a in node.names})
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for inner in (*node.body, *getattr(node, "orelse", ()), *getattr(node, "finalbody", ()),
                          *(s for h in getattr(node, "handlers", ()) for s in h.body)):
                out.update(top_names([inner]))
    return out


def names_module(dotted: str) -> bool:
    """Whether `dotted` is a module of the repository, or a module and an attribute its source defines."""
    parts = dotted.split(".")
    k = next((k for k in range(len(parts), 0, -1) if module_spec(".".join(parts[:k]))), 0)
    spec = module_spec(".".join(parts[:k])) if k else None
    rest = parts[k:]
    if spec is None or not rest or rest[0].startswith("__"):
        return spec is not None
    tree = ast.parse(Path(spec.origin or "").read_text())
    names = top_names(tree.body)
    if rest[0] not in names:  # a lazy attribute: served by __getattr__, which names it as a string
        return "__getattr__" in names and any(isinstance(n, ast.Constant) and n.value == rest[0]
                                              for n in ast.walk(tree))
    node = names[rest[0]]
    return len(rest) == 1 or not isinstance(node, ast.ClassDef) or rest[1] in top_names(node.body)


def missing_modules(t: Text) -> list[str]:
    return [m.group(0) for m in DOTTED.finditer(t.text) if m.group(0) not in NOT_MODULES
            and not any(placeholder(p) for p in m.group(0).split(".")) and not names_module(m.group(0))]


def stale(check) -> list[str]:
    return [f"{t.where}: {name}" for t in texts() for name in check(t)]


def test_every_path_named_in_the_docs_and_docstrings_exists():
    found = stale(missing_paths)
    assert not found, "paths that do not exist:\n" + "\n".join(found)


def test_every_file_named_by_its_bare_name_exists():
    everywhere = known_files()
    found = stale(lambda t: missing_files(t, everywhere))
    assert not found, "files that do not exist (a package docstring lists its own):\n" + "\n".join(found)


def test_every_module_named_in_the_docs_and_docstrings_exists():
    found = stale(missing_modules)
    assert not found, "modules or attributes that do not exist:\n" + "\n".join(found)


def test_the_names_that_are_not_modules_are_strings_of_their_files():
    assert all(f'"{name}"' in (REPO / path).read_text() for name, path in NOT_MODULES.items())


def test_the_checks_read_what_they_are_meant_to():
    """Stale references of each kind are caught, the real ones pass, and the scan reads hundreds of them."""
    page = Text("page", "`position/rope.py`, `hfpatch/tiny.py`, evaluations/NAME.py, `hfpatch.position.patch`, "
                        "`hfpatch.evaluate.engines.register`, hfpatch.evaluate.run, hfpatch.evaluate.engines.Engine."
                        "prepare, `position/rope/builders.py`, --out eval/results/x.json, pre/post",
                (REPO / "docs", REPO, PACKAGE))
    assert missing_paths(page) == ["position/rope.py", "hfpatch/tiny.py"]
    assert missing_modules(page) == ["hfpatch.position.patch"]
    listing = Text("hfpatch/norm/__init__.py:1", "kinds.py, exact.py, patch.py", (), PACKAGE / "norm")
    assert missing_files(listing, known_files()) == ["patch.py"]
    scanned = texts()
    assert sum(len(PATH.findall(t.text)) + len(DOTTED.findall(t.text)) for t in scanned) > 500
    assert {"README.md", "docs/extending.md", "hfpatch/position/registry.py:1"} <= {t.where for t in scanned}
