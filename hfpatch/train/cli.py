"""The command line every recipe shares:

    accelerate launch recipes/<recipe>.py --config recipes/configs/<name>.yaml [key=value ...]

A bad config (unknown key, wrong type, missing data, a sequence length the patch does not support, a model that
cannot be loaded) is one line on stderr and exit code 2, before any training starts.
"""

from __future__ import annotations

import argparse
import os
import sys

from accelerate.utils import set_seed

from .config import ConfigError, load  # noqa: F401 (ConfigError is re-exported to recipes)


def run(recipe: str, main, argv=None) -> int:
    p = argparse.ArgumentParser(prog=recipe, description=f"hfpatch recipe: {recipe}")
    p.add_argument("--config", help="YAML file with the recipe's knobs")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted keys override the YAML (lr=3e-4)")
    args = p.parse_args(argv)
    try:
        cfg = load(recipe, args.config, args.overrides)
        set_seed(cfg.seed)  # before any model is built: from-scratch weights (and LoRA) are reproducible
        main(cfg)
    except ConfigError as e:
        if os.environ.get("RANK", "0") == "0":  # under accelerate launch, one process says it
            print(f"{recipe}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0
