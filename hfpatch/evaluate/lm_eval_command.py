"""`hfpatch lm-eval ARGS`: lm-evaluation-harness's `lm_eval` command with `--model hfpatch` registered.

The model is registered by name ("module:class", lm-eval's lazy registration): the bridge (harness.py, with lm-eval's
HFLM, torch and transformers) is imported when lm-eval first asks for the `hfpatch` model, so `hfpatch lm-eval
--help` (and `ls`, `validate`) answer without importing torch.
"""

from __future__ import annotations

import sys

from ..utils import command

MODEL = "hfpatch"
BRIDGE = "hfpatch.evaluate.harness:HFPatchLM"  # what lm-eval imports when it first asks for MODEL
INSTALL = "the lm-eval bridge needs lm-evaluation-harness: pip install 'hfpatch[lm-eval]'"


def main(argv: list[str] | None = None) -> int:
    """`hfpatch lm-eval ARGS`: lm-eval's command line, with the hfpatch model registered."""
    return command.run_main(_main, list(sys.argv[1:] if argv is None else argv), "hfpatch lm-eval")


def register() -> None:
    """Register MODEL with lm-eval's model registry by name, unless the bridge is registered already (imported)."""
    import lm_eval.models  # noqa: F401 (lm-eval's own models first: its registry adds them only while empty)
    from lm_eval.api.registry import model_registry

    if MODEL not in model_registry:
        model_registry.register(MODEL, target=BRIDGE)


def _main(argv: list[str]) -> int:
    try:
        from lm_eval.__main__ import cli_evaluate

        register()
    except ImportError as e:  # the optional extra is not installed (or not whole)
        raise ImportError(f"{INSTALL} ({e})") from None
    saved = sys.argv
    sys.argv = ["lm-eval", *argv]  # lm-eval's parser reads sys.argv
    try:
        cli_evaluate()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved
    return 0
