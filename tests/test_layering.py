"""The package's layers only point down. Its imports are read with `ast` (nothing is imported) and checked against
LAYERS, the declared table of which parts may import which: a part imports only what its row names, the table has
no cycle, no module imports itself back through others, names imported across modules are public, and imports
inside functions are only those of optional extras (docs/extending.md, "Layers"). Inside each folder of the package
the same holds without a table: no module or sub-folder imports another that imports it back, through any import
(at the top, inside a function, or for the type checker only)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from eval.code_metrics import import_targets, module_names

PACKAGE = Path(__file__).resolve().parents[1] / "hfpatch"

# part -> the parts it may import. A part is a top-level module of the package or a sub-package; "hfpatch" is the
# package's own __init__ (the public API). Lower parts first.
LAYERS: dict[str, set[str]] = {
    # utilities that know nothing of models
    "registry": set(),  # one Registry class for every registry
    "utils": set(),  # one-line command errors, locks and hashes, free memory, timing, warnings
    "edits": set(),  # the one layer that changes live objects
    "tiny": set(),  # tiny models of every family, from their own configs
    # the core: reading a model, the registries and their appliers, the patch
    "adapters": {"edits"},  # architecture knowledge, read off the model
    "position": {"adapters", "edits", "registry", "utils"},  # rope/, attention/, schemes/, the SCHEMES registry
    # the NORMS and PLACEMENTS registries, norm modules, swaps, fits
    "norm": {"adapters", "edits", "registry", "utils"},
    "spec": {"position", "norm"},  # the patch spec, validated against the registries
    "patch_state": {"spec", "adapters", "position", "edits"},  # what a patched model carries: state, facts
    "save_marks": {"patch_state", "adapters", "norm", "edits"},  # what a patched model's folder says to loaders
    "apply": {"spec", "adapters", "norm", "position", "edits", "patch_state", "save_marks", "utils"},  # patch / unpatch
    "introspect": {"apply", "spec", "adapters", "norm", "position"},  # describe, length limits, what applies
    # in and out: other formats and engines, loading by name
    # io, gguf, serving
    "interop": {"apply", "introspect", "spec", "adapters", "edits", "position", "registry", "utils"},
    "io": {"interop"},  # re-export of the old path, for one version
    "gguf": {"interop"},  # re-export of the old path, for one version
    "models": {"introspect", "interop", "apply", "utils"},  # load by name
    # supported(): every family measured
    "families": {"apply", "introspect", "adapters", "norm", "position", "tiny", "utils"},
    "patch_options": {"position", "norm"},  # `hfpatch patch`'s flags as data; the registries read to check them
    "plugins": set(),  # extensions installed as packages (entry points), loaded by the command
    "hfpatch": {"introspect", "spec", "apply", "families", "interop"},  # the public API
    # running models: what evaluations and training share, then each
    # a causal LM as body + head; documents and tokenizers
    "lm": {"apply", "introspect", "adapters", "models", "interop", "utils"},
    "evaluate": {"hfpatch", "introspect", "position", "apply", "spec", "adapters", "lm", "models", "interop",
                 "registry", "utils"},
    # the search over patches: candidates, the objective, the resumable loop (over the evaluations' machinery)
    "search": {"evaluate", "apply", "introspect", "adapters", "position", "lm", "models", "registry", "utils"},
    "train": {"hfpatch", "introspect", "apply", "spec", "adapters", "norm", "position", "edits", "lm", "models",
              "registry", "utils"},
    "cli": {"hfpatch", "introspect", "evaluate", "lm", "search", "norm", "spec", "models", "families", "apply",
            "interop", "position", "utils", "patch_options", "plugins"},
    "__main__": {"cli"},
}

# Modules that may be imported inside a function, and why: the optional extras, and what only an optional path needs
# while costing seconds to import for everyone else.
OPTIONAL = {
    "peft": "the peft extra: LoRA in the recipes",
    "lm_eval": "the lm-eval extra: the lm-evaluation-harness bridge",
    "datasets": "only --dataset / data.dataset read it, and importing it costs about a second",
    "flash_attn": "flash-attention, where installed: the flash_attention_2 paths of alibi and self-extend, and "
                  "FlashAttention-4's (flash_attn.cute) fa4 paths",
    "cutlass": "NVIDIA's CuTe DSL, which FlashAttention-4 brings: the fa4 paths' score_mods are written in it",
    "gguf": "the gguf extra: reading and writing GGUF files",
    "llama_cpp": "the llama-cpp extra: the llama.cpp engine of the evaluations",
    "vllm": "vLLM, in its own Python: the vLLM engine's worker runs there, never in hfpatch's",
}
# Files whose imports are deferred on purpose, so that `hfpatch --help` does not load torch: the command's entry point
# imports each subcommand's modules when it runs, the evaluations' package (which the command reads for the list
# of evaluations) imports its Python API on first use, and an evaluation's command (evaluate/definition.py) imports
# the sweep once its arguments parse, so that `hfpatch eval NAME --help` does not load torch either. Each of these
# deferred imports points down: what they import does not import them back (test_no_import_cycle_inside_a_folder
# counts deferred imports too, and allows none).
ENTRY_POINTS = {"hfpatch/cli.py", "hfpatch/evaluate/__init__.py", "hfpatch/evaluate/definition.py",
                # the search's package imports search() on first use, and its command the model and the loop once
                # its arguments parse: `hfpatch search --help` loads no torch
                "hfpatch/search/__init__.py", "hfpatch/search/command.py",
                # `hfpatch patch`'s flags as plain data: the registries (torch) are read only to check the data against
                # them, or where a process has imported them already
                "hfpatch/patch_options.py"}
# Files that import one heavy library only where it is used, and which: every evaluation module imports the plots'
# module, and an evaluation's --help must not load matplotlib (about 0.4 s).
DEFERRED = {"hfpatch/evaluate/plots.py": {"matplotlib"}}


MODULES = module_names(PACKAGE)


def part_of(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def _targets(node, module: str) -> list[str]:
    """The package's modules an import statement in `module` imports (a name that is a submodule counts as it)."""
    return import_targets(node, module, MODULES, PACKAGE.name)


def _imports(module: str):
    """(node, in a function?) for every import statement of `module`."""
    tree = ast.parse(MODULES[module].read_text())
    inner = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f)}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, id(node) in inner


def _where(module: str, node) -> str:
    return f"{MODULES[module].relative_to(PACKAGE.parent)}:{node.lineno}"


def upward_imports() -> list[str]:
    """Imports of a part its row in LAYERS does not name."""
    bad = []
    for module in MODULES:
        for node, _ in _imports(module):
            for target in _targets(node, module):
                here, there = part_of(module), part_of(target)
                if here != there and there not in LAYERS.get(here, set()):
                    bad.append(f"{_where(module, node)}: {here} imports {target} ({there} is not below {here})")
    return bad


def cycles() -> list[list[str]]:
    """Cycles among the package's modules through their module-level imports. Importing a module imports its parent
    packages first, except those of the importing module itself (they are being imported already)."""
    graph = defaultdict(set)
    for module in MODULES:
        own = {".".join(module.split(".")[:k]) for k in range(1, module.count(".") + 2)}
        for node, inside in _imports(module):
            if inside:
                continue
            for target in _targets(node, module):
                parts = target.split(".")
                parents = {".".join(parts[:k]) for k in range(1, len(parts))}
                graph[module] |= ({target} | parents - own) - {module}
    found, state, stack = [], {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                found.append([*stack[stack.index(t):], t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = "done"

    for m in sorted(MODULES):
        if m not in state:
            visit(m)
    return found


def folders() -> list[str]:
    """The package's folders below its top (the top's parts are LAYERS' to order)."""
    return sorted(m for m, path in MODULES.items() if path.name == "__init__.py" and "." in m)


def entry(module: str, folder: str) -> str:
    """What `module` is among `folder`'s entries: one of its modules, one of its sub-folders (as a whole), or its own
    __init__."""
    return "__init__" if module == folder else module[len(folder) + 1:].split(".")[0]


def folder_imports(folder: str) -> dict[tuple[str, str], list[str]]:
    """(entry, entry it imports) -> where, for every import between two entries of `folder`: at the top, inside a
    function or for the type checker only (an import of a package's __init__ that only loading a sub-module makes is
    not one)."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for module in MODULES:
        if not module.startswith(folder + ".") and module != folder:
            continue
        for node, _ in _imports(module):
            for target in _targets(node, module):
                if target.startswith(folder + ".") or target == folder:
                    a, b = entry(module, folder), entry(target, folder)
                    where = f"{_where(module, node)} imports {target}"
                    if a != b and where not in edges[(a, b)]:
                        edges[(a, b)].append(where)
    return edges


def folder_cycles() -> list[str]:
    """Every group of entries of a folder that import each other round (a strongly connected component of more than
    one entry), with the imports inside it."""
    found = []
    for folder in folders():
        edges = folder_imports(folder)
        graph = defaultdict(set)
        for a, b in edges:
            graph[a].add(b)
        for group in _components(graph):
            imports = [w for (a, b), where in sorted(edges.items()) if a in group and b in group for w in where]
            found.append(f"{folder}: {', '.join(sorted(group))}\n    " + "\n    ".join(imports))
    return found


def _components(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components of `graph` with more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(group)

    for v in sorted({*graph, *(w for ws in graph.values() for w in ws)}):
        if v not in index:
            visit(v)
    return out


def test_every_part_is_in_the_table():
    assert {part_of(m) for m in MODULES} == set(LAYERS)


def test_the_table_points_one_way():
    order, left = [], dict(LAYERS)
    while left:
        ready = [p for p, deps in left.items() if deps <= set(order)]
        assert ready, f"LAYERS has a cycle among {sorted(left)}"
        order += ready
        for p in ready:
            del left[p]


def test_no_upward_import():
    bad = upward_imports()
    assert not bad, "imports that point up:\n" + "\n".join(bad)


def test_no_import_cycle():
    found = cycles()
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_imports_inside_functions_are_optional_extras():
    bad = []
    for module, path in MODULES.items():
        if path.relative_to(PACKAGE.parent).as_posix() in ENTRY_POINTS:
            continue
        for node, inside in _imports(module):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [
                "." * node.level + (node.module or "")]
            allowed = set(OPTIONAL) | DEFERRED.get(path.relative_to(PACKAGE.parent).as_posix(), set())
            if inside and any(n.split(".")[0] not in allowed for n in names):
                bad.append(f"{_where(module, node)}: import of {', '.join(names)} inside a function")
    assert not bad, "imports that belong at the top of their file:\n" + "\n".join(bad)


def test_names_imported_across_modules_are_public():
    bad = []
    for module in MODULES:
        for node, _ in _imports(module):
            if isinstance(node, ast.ImportFrom) and _targets(node, module):
                bad += [f"{_where(module, node)}: {a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    assert not bad, "private names imported from another module:\n" + "\n".join(bad)


def test_no_import_cycle_inside_a_folder():
    """Inside every folder, its modules and sub-folders import one way: none imports another that imports it back,
    whether at the top of a file, inside a function (an entry point's deferred import) or for the type checker. So
    the entries of each folder have an order in which every import points down (position/: checks, requirements,
    search_space, spaces, rope/, attention/, schemes/, signal, layers, registry)."""
    found = folder_cycles()
    assert not found, "entries of a folder that import each other back:\n" + "\n".join(found)
