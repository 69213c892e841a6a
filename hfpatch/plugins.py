"""Extensions installed as packages. A distribution that declares an entry point in the group `hfpatch.plugins` is
loaded by the `hfpatch` command before it reads its arguments, so the position schemes, norms, evaluations and
engines it registers are on the command line as hfpatch's own (`hfpatch patch --position NAME`, `hfpatch eval NAME`,
`--engine NAME`, `hfpatch search --families NAME`). The entry point names a module, which registers its extensions
when imported, or a callable, which is called with no arguments:

    [project.entry-points."hfpatch.plugins"]
    mine = "mypackage.hfpatch_extensions"             # a module
    echo = "mypackage.evaluations:register"           # a callable

A plugin that fails to load stops the command with one line naming it; `HFPATCH_PLUGINS=off` runs the command
without any (as PYTEST_DISABLE_PLUGIN_AUTOLOAD does for pytest). A Python program imports its extensions itself: the
library never loads plugins on its own. This module imports nothing of hfpatch, so a command's --help stays as quick
as its plugins let it.
"""

from __future__ import annotations

import importlib.metadata
import os

GROUP = "hfpatch.plugins"
OFF = "HFPATCH_PLUGINS"  # "off" (or "0", "false", "no"): load none
_LOADED: list[str] = []  # the plugins loaded in this process: each is loaded once (a second load would register its
                         # extensions twice)


class PluginError(ImportError):
    """A plugin that could not be loaded (its message is one line, naming it)."""


def plugins_off() -> bool:
    return os.environ.get(OFF, "").strip().lower() in ("off", "0", "false", "no")


def load_plugins() -> list[str]:
    """Import (or call) every installed plugin not loaded yet in this process, in name order; the names of all
    loaded. A failure is a PluginError naming the plugin, the distribution it comes from and what went wrong."""
    if plugins_off():
        return list(_LOADED)
    for entry in sorted(importlib.metadata.entry_points(group=GROUP), key=lambda e: e.name):
        if entry.name in _LOADED:
            continue
        try:
            target = entry.load()
            if callable(target):
                target()
        except Exception as e:  # a plugin's own failure, whatever it is, is reported as that plugin's
            dist = f" from {entry.dist.name}" if entry.dist is not None else ""
            raise PluginError(f"hfpatch plugin {entry.name!r} ({entry.value}{dist}) failed to load: "
                              f"{type(e).__name__}: {' '.join(str(e).split())} (set {OFF}=off to run without "
                              "plugins)") from None
        _LOADED.append(entry.name)
    return list(_LOADED)
