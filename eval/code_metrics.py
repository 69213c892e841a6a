"""How the code reads, in numbers: what a contributor touches to add a scheme, and how big and typed the parts are.

    python -m eval.code_metrics --label after --out eval/results/code/after.json

Measured by reading the source (ast); only the scheme registry is imported, for the scheme names:
- files per scheme: for each position scheme, the files of the package (hfpatch/) that name it as a string literal
  (a branch on its name, a table keyed by it, a registration); the mean and the largest count;
- scheme-keyed tables: module-level dict/set literals with two or more scheme names among their keys, plus the
  `register` functions called with a scheme name (one table per function and file, however many calls);
- imports inside functions (package, eval/ scripts, recipes), and `sys.path` edits;
- the largest file of the package and the longest function (lines), and every file over FILE_LINES lines and every
  function over FUNCTION_LINES lines (a nested function counts inside its parent too) with the reason written
  beside its `def`, if any;
- the share of function arguments (self/cls excluded) that carry a type annotation, in the package;
- the share of the package's functions and methods (nested ones included) that declare a return type;
- ruff's error count over the repository's Python (LINTED: the package, tests, eval scripts, recipes), with the
  repository's own ruff settings, and per folder (needs ruff; without it the count is null);
- the pairs of places that `duplicates` finds (six or more shared lines) in the repository and in each of
  DUPLICATE_FOLDERS (needs the `duplicates` command on PATH; without it the counts are null).
- the lines of the package's modules, in all and per part (a top-level module or folder of hfpatch/);
- import cycles inside the package's folders: for each folder, the graph of its entries (modules and sub-folders)
  with an edge wherever one imports from another (at the top or inside a function); the folders whose graph has a
  cycle, and the imports that lie on one (an import back up a folder's layers closes a cycle).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import shutil
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

from hfpatch.position import SCHEMES

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "hfpatch"
FILE_LINES = 500  # the project's bound on a module of the package
FUNCTION_LINES = 60  # the project's bound on a function without a reason written beside it
LINTED = ("hfpatch", "tests", "eval", "recipes")  # what CI runs ruff over
DUPLICATE_FOLDERS = ("hfpatch", "tests", "eval", "recipes")


def python_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def scheme_names() -> list[str]:
    """The registered position schemes, from the registry itself."""
    return sorted(SCHEMES)


def string_constants(tree: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def files_per_scheme(trees: dict[Path, ast.AST], names: list[str]) -> dict[str, int]:
    strings = {path: string_constants(tree) for path, tree in trees.items()}
    return {name: sum(name in s for s in strings.values()) for name in names}


def scheme_tables(trees: dict[Path, ast.AST], names: set[str]) -> list[str]:
    """Places keyed by scheme names: module-level dict/set literals and registration calls."""
    found = []
    for path, tree in trees.items():
        rel = path.relative_to(REPO)
        for node in getattr(tree, "body", []):
            value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
            keys = value.keys if isinstance(value, ast.Dict) else value.elts if isinstance(value, ast.Set) else []
            if sum(isinstance(k, ast.Constant) and k.value in names for k in keys) >= 2:  # one could be chance
                target = node.targets[0] if isinstance(node, ast.Assign) else node.target
                found.append(f"{rel}:{getattr(target, 'id', '?')}")
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and n.args]
        for call in calls:
            first = call.args[0]
            if isinstance(first, ast.Constant) and first.value in names and "register" in ast.unparse(call.func):
                found.append(f"{rel}:{ast.unparse(call.func)}(...)")  # one registry, however many calls
    return sorted(set(found))


def functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def reason_beside(source: list[str], f: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """The comment written beside a function's `def` (on its line, or the line above it and its decorators): where
    the project's standard wants the reason a long function stays whole."""
    first = min([f.lineno, *(d.lineno for d in f.decorator_list)])
    for line in (source[f.lineno - 1], source[first - 2] if first > 1 else ""):
        code, sep, comment = line.partition("#")
        if sep and (line is source[f.lineno - 1] or not code.strip()):
            return comment.strip()
    return None


def imports_in_functions(tree: ast.AST) -> int:
    return sum(isinstance(n, (ast.Import, ast.ImportFrom)) for f in functions(tree) for n in ast.walk(f))


def sys_path_edits(tree: ast.AST) -> int:
    return sum(isinstance(n, ast.Call) and ast.unparse(n.func).startswith("sys.path.") for n in ast.walk(tree))


def annotation_coverage(trees: dict[Path, ast.AST]) -> tuple[int, int]:
    annotated = total = 0
    for tree in trees.values():
        for f in functions(tree):
            a = f.args
            args = [*a.posonlyargs, *a.args, *a.kwonlyargs, *([a.vararg] if a.vararg else []),
                    *([a.kwarg] if a.kwarg else [])]
            for arg in args:
                if arg.arg in ("self", "cls"):
                    continue
                total += 1
                annotated += arg.annotation is not None
    return annotated, total


def return_annotation_coverage(trees: dict[Path, ast.AST]) -> tuple[int, int]:
    """Functions and methods (nested ones too) with a return annotation, and all of them."""
    defs = [f for tree in trees.values() for f in functions(tree)]
    return sum(f.returns is not None for f in defs), len(defs)


def ruff_errors(repo: Path) -> dict:
    """ruff's errors over LINTED in `repo` (its own settings), in all and per folder; null counts without ruff."""
    folders = [name for name in LINTED if (repo / name).is_dir()]
    command = [sys.executable, "-m", "ruff"] if find_spec("ruff") is not None else [shutil.which("ruff") or "ruff"]
    try:
        done = subprocess.run([*command, "check", "--output-format", "json", "--exit-zero", *folders], cwd=repo,
                              capture_output=True, text=True, check=True)
        version = subprocess.run([*command, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {"ruff": None, "errors": None, "per_folder": None}
    found = [Path(e["filename"]).resolve().relative_to(repo.resolve()).parts[0] for e in json.loads(done.stdout)]
    return {"ruff": version.split()[-1], "errors": len(found),
            "per_folder": {name: found.count(name) for name in folders}}


def duplicate_pairs(repo: Path) -> dict:
    """The number of pairs `duplicates` lists over `repo` and over each of DUPLICATE_FOLDERS, with the rows of the
    folders' pairs; null counts without the command."""
    counts: dict[str, int | None] = {"repository": _duplicates(repo)[0]}
    rows: list[str] = []
    for name in DUPLICATE_FOLDERS:
        if (repo / name).is_dir():
            counts[name], found = _duplicates(repo / name)
            rows += [re.sub(r"(^|~ )", rf"\g<1>{name}/", row) for row in found]
    return {"pairs": counts, "rows": rows}


def _duplicates(folder: Path) -> tuple[int | None, list[str]]:
    """`duplicates --repo folder`: how many pairs it counts, and its rows (each pair's places, without its label)."""
    if shutil.which("duplicates") is None:
        return None, []
    out = subprocess.run(["duplicates", "--repo", str(folder), "--most", "200", "--seconds", "300"],
                         capture_output=True, text=True, check=False).stdout
    if any(line.startswith("incomplete:") for line in out.splitlines()):
        raise RuntimeError(f"duplicates did not read all of {folder}:\n{out}")
    head = re.match(r"(\d+) pairs? of places|no duplicates", out)
    if head is None:
        raise RuntimeError(f"duplicates answered in a form not known here:\n{out}")
    return int(head.group(1) or 0), [line.split(" ", 1)[1] for line in out.splitlines() if re.match(r"D\d+ ", line)]


def package_lines(package: Path) -> dict:
    """Lines of the package's modules: in all, and per part (its top-level modules and folders), largest first."""
    parts: dict[str, int] = {}
    for path in python_files(package):
        rel = path.relative_to(package)
        part = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        parts[part] = parts.get(part, 0) + len(path.read_text().splitlines())
    return {"total": sum(parts.values()), "parts": dict(sorted(parts.items(), key=lambda kv: (-kv[1], kv[0])))}


def module_names(package: Path) -> dict[str, Path]:
    """{dotted module name: file} of the package (a folder's __init__ is the folder's name)."""
    out = {}
    for path in python_files(package):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_targets(node: ast.Import | ast.ImportFrom, module: str, modules: dict[str, Path],
                   root: str) -> list[str]:
    """The package's modules an import statement of `module` imports (a name that is a module counts as it)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module if modules[module].name == "__init__.py" else module.rpartition(".")[0]
            kept = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join(kept + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    out = []
    for name in names:
        if name.split(".")[0] != root:
            continue
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name:
            out.append(name)
    return out


def import_cycles(package: Path) -> dict:
    """Folders of the package whose entries import each other back, and the imports that lie on such a cycle."""
    modules = module_names(package)
    edges: dict[str, set[tuple[str, str]]] = {}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in import_targets(node, module, modules, package.name):
                a, b = module.split("."), target.split(".")
                k = 0
                while k < min(len(a), len(b)) and a[k] == b[k]:
                    k += 1
                if k < len(a) and k < len(b):  # two entries of the folder a[:k]
                    edges.setdefault(".".join(a[:k]), set()).add((a[k], b[k]))
    folders, on_cycle = [], 0
    for folder, pairs in sorted(edges.items()):
        reach: dict[str, set[str]] = {}
        for a, b in pairs:
            reach.setdefault(a, set()).add(b)
        changed = True
        while changed:
            changed = False
            for seen in reach.values():
                more = set().union(*(reach.get(m, set()) for m in seen)) - seen
                if more:
                    seen |= more
                    changed = True
        cyclic = [(a, b) for a, b in pairs if a in reach.get(b, set())]
        if cyclic:
            folders.append(folder.replace(".", "/"))
            on_cycle += len(cyclic)
    return {"folders": folders, "imports_on_cycles": on_cycle}


def measure() -> dict:
    parse = {p: ast.parse(p.read_text(), str(p)) for p in python_files(REPO / "hfpatch")}
    returns, defs = return_annotation_coverage(parse)
    scripts = {p: ast.parse(p.read_text(), str(p)) for root in ("eval", "recipes") for p in python_files(REPO / root)}
    names = scheme_names()
    per_scheme = files_per_scheme(parse, names)
    lengths = sorted(((f.end_lineno - f.lineno + 1, f"{p.relative_to(REPO)}:{f.name}",
                       reason_beside(p.read_text().splitlines(), f)) for p, t in parse.items() for f in functions(t)),
                     key=lambda x: (-x[0], x[1]))
    longest = lengths[0] if lengths else (0, "", None)
    sizes = sorted(((len(p.read_text().splitlines()), str(p.relative_to(REPO))) for p in parse),
                   key=lambda x: (-x[0], x[1]))
    largest = sizes[0]
    annotated, total = annotation_coverage(parse)
    tables = scheme_tables(parse, set(names))
    return {
        "files_per_scheme": per_scheme,
        "files_per_scheme_mean": round(sum(per_scheme.values()) / len(per_scheme), 2),
        "files_per_scheme_max": max(per_scheme.values()),
        "scheme_tables": tables,
        "scheme_tables_count": len(tables),
        "imports_in_functions": {"package": sum(map(imports_in_functions, parse.values())),
                                 "scripts": sum(map(imports_in_functions, scripts.values()))},
        "sys_path_edits": sum(map(sys_path_edits, [*parse.values(), *scripts.values()])),
        "largest_file": {"path": largest[1], "lines": largest[0]},
        "longest_function": {"name": longest[1], "lines": longest[0]},
        "files_over": {"limit": FILE_LINES,
                       "files": [{"path": path, "lines": n} for n, path in sizes if n > FILE_LINES]},
        "functions_over": {"limit": FUNCTION_LINES,
                           "functions": [{"name": name, "lines": n, "reason": reason}
                                         for n, name, reason in lengths if n > FUNCTION_LINES]},
        "annotated_arguments": {"annotated": annotated, "total": total, "share": round(annotated / total, 3)},
        "annotated_returns": {"annotated": returns, "total": defs, "share": round(returns / defs, 3)},
        "ruff_errors": ruff_errors(REPO),
        "duplicates": duplicate_pairs(REPO),
        "package_files": len(parse),
        "package_lines": package_lines(REPO / "hfpatch"),
        "import_cycles": import_cycles(REPO / "hfpatch"),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", required=True, help="the name of this measurement (before, after)")
    parser.add_argument("--out", help="write the JSON here (else print it)")
    args = parser.parse_args(argv)
    data = {"label": args.label, **measure()}
    text = json.dumps(data, indent=1) + "\n"
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
