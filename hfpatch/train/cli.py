"""The command line every recipe shares:

    accelerate launch recipes/<recipe>.py --config recipes/configs/<name>.yaml [key=value ...]

A bad config (unknown key, wrong type, missing data, a sequence length the patch does not support, a model that
cannot be loaded) is one line on stderr and exit code 2, before any training starts. output_dir is locked for the
whole run (by the main process): a second run on it is refused with the pid of the one that holds it. A run that
fails while it trains (a loss that is no longer finite, a full disk) is one line and exit code 1; its last complete
checkpoint is kept. Ctrl-C is one line with the command that resumes the run, and exit code 130.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path

from accelerate.utils import set_seed

from ..utils.files import Lock, Locked, describe_os_error, write_failure
from .config import ConfigError, RunFailed, check_fresh, load  # ConfigError is also re-exported to recipes

LOCK = "hfpatch.lock"  # in output_dir; held by the main process while the run lives


def run(recipe: str, main, argv=None) -> int:
    p = argparse.ArgumentParser(prog=recipe, description=f"hfpatch recipe: {recipe}")
    p.add_argument("--config", help="YAML file with the recipe's knobs")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted keys override the YAML (lr=3e-4)")
    args = p.parse_args(argv)
    main_process = os.environ.get("RANK", "0") == "0"  # under accelerate launch, one process locks and speaks
    try:
        cfg = load(recipe, args.config, args.overrides, check_previous=False)
        with holding(Path(cfg.output_dir)) if main_process else contextlib.nullcontext():
            if main_process:
                check_fresh(cfg)
            set_seed(cfg.seed)  # before any model is built: from-scratch weights (and LoRA) are reproducible
            main(cfg)
    except ConfigError as e:
        if main_process:
            print(f"{recipe}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the checkpoints are published whole, the newest complete one resumes
        if main_process:
            print(f"{recipe}: interrupted; continue from the newest complete checkpoint with: "
                  f"{resume_command(recipe, args.config, args.overrides)}", file=sys.stderr)
        return 130
    except (RunFailed, OSError) as e:
        if main_process:
            what = str(e)
            if isinstance(e, OSError):  # the checkpoints are published whole: the newest complete one is intact
                what = f"{write_failure(e)}; the newest complete checkpoint is kept: resume=true continues from it"
            print(f"{recipe}: error: {' '.join(what.split())}", file=sys.stderr)
        return 1
    return 0


def resume_command(recipe: str, config: str | None, overrides: list[str]) -> str:
    """The command line that resumes this run: its own, resume=true in place of any resume= it had."""
    script = sys.argv[0] if Path(sys.argv[0]).name == f"{recipe}.py" else f"recipes/{recipe}.py"
    kept = [o for o in overrides if o.partition("=")[0].strip() != "resume"]
    given = ["--config", config] if config else []
    return shlex.join(["accelerate", "launch", script, *given, *kept, "resume=true"])


@contextlib.contextmanager
def holding(out: Path) -> Iterator[None]:
    """output_dir created if needed and locked while the run lives. A run refused before it wrote anything leaves
    no folder behind (nor an empty one it created)."""
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock = Lock(out / LOCK, f"output_dir {out}")
    except Locked as e:
        raise ConfigError(str(e)) from None
    except OSError as e:
        raise ConfigError(f"output_dir {out}: cannot create it or write in it ({describe_os_error(e)})") from None
    try:
        yield
    except ConfigError:
        if created and [p.name for p in out.iterdir()] == [LOCK]:
            (out / LOCK).unlink()
            lock.close()
            out.rmdir()
        raise
    finally:
        lock.close()
