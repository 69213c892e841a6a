"""What every hfpatch command shares: an argument parser whose errors are one line, and the run wrapper that turns
input errors into one line on stderr and exit code 2, and Python warnings into one line each (the `hfpatch`
command, the evaluations, the search, the lm-eval bridge). It sits below all of them, so none imports another to
get it."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NoReturn


class UsageError(Exception):
    pass


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2 (argparse prints the whole usage by default)
        raise UsageError(f"{self.prog}: error: {message}")


def run_main(fn: Callable[..., Any], argv: list[str] | None, prog: str, interrupted: str | None = None) -> int:
    """Run a command (`fn(argv)`); bad input is one line on stderr and exit code 2, a Python warning one line
    (`PROG: warning: ...`). With `interrupted`, Ctrl-C prints that hint and exits with 130 (the evaluations say how
    to resume)."""
    with one_line_warnings(prog):
        return _run(fn, argv, prog, interrupted)


@contextlib.contextmanager
def one_line_warnings(prog: str) -> Iterator[None]:
    """Python warnings shown as one line each, `PROG: warning: message`, as the commands' own warnings are (Python's
    own form adds the file, the line number and the line of code that warned, the lines of a traceback)."""
    def one_line(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                 line: str | None = None) -> str:
        return f"{prog}: warning: {' '.join(str(message).split()).removeprefix('hfpatch: ')}\n"

    default = warnings.formatwarning
    warnings.formatwarning = one_line
    try:
        yield
    finally:
        warnings.formatwarning = default


def _run(fn: Callable[..., Any], argv: list[str] | None, prog: str, interrupted: str | None) -> int:
    try:
        return fn(argv)
    except UsageError as e:
        print(str(e), file=sys.stderr)
        return 2
    except (ValueError, TypeError, FileNotFoundError, ImportError) as e:
        print(f"{prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader stopped early (`| head`): not an error of ours, and no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's flush at exit would raise again
        return 1
    except KeyboardInterrupt:
        if interrupted is None:
            raise
        print(f"{prog}: interrupted; {interrupted}", file=sys.stderr)
        return 130
