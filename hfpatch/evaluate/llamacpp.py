"""The llama.cpp engine of the evaluations: `hfpatch eval ppl|passkey|ruler|niah --engine llama.cpp`.

The same cells as the transformers engine: the same tokens (the evaluation tokenizes with the GGUF's transformers
tokenizer and hands llama.cpp the token ids), the same windows, prompts, scoring and results file. A patch spec is
applied the way a served GGUF carries it: the RoPE metadata `hfpatch.interop.gguf.export` writes for it, given to
llama.cpp as metadata overrides (`kv_overrides`), or, for schemes that live in tensors (llama3, LongRoPE) or when the
file already carries a scaling of its own, a copy of the file exported with that spec. YaRN's betas, which the llama
loader does not read from metadata, are passed as context parameters. What a GGUF cannot carry (dynamic scaling,
ALiBi, Self-Extend, norm swaps, ...) is refused before any work, with the reason.

Scoring: llama-cpp-python's `Llama(path, n_ctx, logits_all=True)`, `.eval(ids)` and `.scores` (float32 logits of
every position); the log-softmax is taken in float64 here. Greedy decoding evaluates the prompt once, then one token
at a time on llama.cpp's KV cache, taking the argmax of the last logits.

llama.cpp fixes the RoPE when a context is created: one context serves a cell's units, and LongRoPE's choice between
its short and long factors follows the context size (rounded up to 256 tokens for decoding), where transformers
follows the current sequence length.

Weights are read as stored: llama.cpp's extra CPU buffer types, which repack weights at load time for AMX and other
instruction sets, are turned off (`use_extra_bufts`): on a CPU with AMX, llama-cpp-python 0.3.36 repacks the Q4_1
file's weights for AMX and then crashes (a segmentation fault) in its first decode. The plain CPU kernels read the
same weights.

Needs the optional extra llama-cpp-python (pip install 'hfpatch[llama-cpp]'); it compiles llama.cpp on install.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import math
import os
import shutil
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

try:
    import fcntl
except ImportError:  # not on Windows: exports are then only removed by the run that made them
    fcntl = None  # type: ignore[assignment]  # checked for None before use

from .. import spec as specs
from ..interop import gguf as hg
from ..lm import budget
from ..models import gguf_path
from .engines import Engine

NAME = "llama.cpp"
RUNTIME_OPTIONS = {"beta_fast": "yarn_beta_fast", "beta_slow": "yarn_beta_slow"}  # context parameters
DECODE_CTX_STEP = 256  # decoding contexts are sized in steps of this many tokens, so that trials share one


def check_installed() -> None:
    try:
        import llama_cpp  # noqa: F401  - an optional extra
    except ImportError:
        raise ImportError("--engine llama.cpp needs llama-cpp-python: pip install 'hfpatch[llama-cpp]' (it "
                          "compiles llama.cpp, which takes a while)") from None


@contextlib.contextmanager
def weights_as_stored() -> Iterator[None]:
    """While a Llama is built: llama.cpp's model parameters with its extra buffer types off (no load-time repacking
    of the weights; the module docstring says why). llama-cpp-python takes no argument for it, so the default
    parameters it starts from are wrapped, and restored after."""
    import llama_cpp.llama_cpp as native  # an optional extra; llama_cpp.llama reads the defaults from here

    defaults = native.llama_model_default_params

    def as_stored() -> Any:
        params = defaults()
        params.use_extra_bufts = False
        return params

    native.llama_model_default_params = as_stored
    try:
        yield
    finally:
        native.llama_model_default_params = defaults


@dataclass
class Setting:
    """How one patch spec runs in llama.cpp."""

    path: str  # the GGUF file to load
    kv_overrides: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict)  # Llama(...) context parameters
    exported: bool = False  # path is a copy exported with the spec


class LlamaCppModel:
    """A GGUF file run by llama.cpp, with the spec applied now; scores and decodes like lm.LMParts."""

    def __init__(self, path: str, threads: int | None = None) -> None:
        self.path = path
        self.threads = threads or os.cpu_count() or 1
        self.info = hg.read_rope(hg.open_gguf(path))
        # A file that carries a scaling of its own (a rope_freqs tensor, a yarn type...) is exported again for
        # each spec: metadata overrides cannot take a tensor or a key out.
        self.scaled = bool(self.info.keys or self.info.tensors)
        self.setting = Setting(path)
        remove_stale_exports()
        self._tmp, held = exports_folder()
        # the exported copies go with the model (and the lock on them with the process)
        self.remove_exports = weakref.finalize(self, remove_exports, self._tmp, held)
        self._exports: dict = {}
        self._llm: Any = None  # a llama_cpp.Llama (an optional extra)
        self._key: tuple | None = None

    # --------------------------------------------------------------------------------------------- patch specs

    def setting_for(self, kwargs: dict) -> Setting:
        """The Setting of a patch spec (`hfpatch.patch` keyword arguments), or ValueError saying why llama.cpp
        cannot run it."""
        if not kwargs:
            return Setting(self.path)
        specs.request(**kwargs)  # the spec itself is valid
        position = {k: v for k, v in kwargs.items() if k not in RUNTIME_OPTIONS}
        runtime = {RUNTIME_OPTIONS[k]: float(v) for k, v in kwargs.items() if k in RUNTIME_OPTIONS}
        pos = hg.request(**position, trained_window=lambda: self.info.window)
        p = hg.plan(self.info, pos)
        if p.tensors or self.scaled:
            return Setting(self._export(pos), params=runtime, exported=True)
        overrides = {f"{self.info.arch}.{k}": (int(v) if kind == "u32" else v) for k, (v, kind) in p.keys.items()}
        return Setting(self.path, overrides, runtime)

    def _export(self, pos: dict) -> str:
        key = repr(sorted(pos.items()))
        if key not in self._exports:
            out = os.path.join(self._tmp, f"spec{len(self._exports)}.gguf")
            hg.export(self.path, out, **specs.to_kwargs({"position": pos}))
            self._exports[key] = out
        return self._exports[key]

    @contextlib.contextmanager
    def applied(self, kwargs: dict, name: str) -> Iterator[LlamaCppModel]:
        try:
            setting = self.setting_for(kwargs)
        except (ValueError, TypeError) as e:
            raise type(e)(f"patch spec {name!r} with --engine llama.cpp: {e}") from None
        before, self.setting = self.setting, setting
        try:
            yield self
        finally:
            self.setting = before

    # ----------------------------------------------------------------------------------------------- contexts

    def llm(self, n_ctx: int) -> Any:
        """A llama.cpp context of n_ctx tokens for the current setting (kept while both stay the same)."""
        from llama_cpp import Llama  # an optional extra

        s = self.setting
        key = (s.path, tuple(sorted(s.kv_overrides.items())), tuple(sorted(s.params.items())), n_ctx)
        if key != self._key:
            self.close_context()
            with weights_as_stored():
                self._llm = Llama(s.path, n_ctx=n_ctx, n_batch=min(512, n_ctx), logits_all=True, verbose=False,
                                  n_threads=self.threads, n_threads_batch=self.threads,
                                  kv_overrides=dict(s.kv_overrides) or None, **s.params)
            self._key = key
        self._llm.reset()
        return self._llm

    def close_context(self) -> None:
        if self._llm is not None:
            self._llm.close()
            self._llm, self._key = None, None

    def close(self) -> None:
        self.close_context()
        self.remove_exports()

    def document_nll(self, ids: Any, spans: Any, chunk: int = 0, progress: Any = None) -> tuple[float, int, list]:
        """lm.document_nll in llama.cpp: (nll sum, tokens scored, scored runs) over the windows of `ids` (`chunk`,
        the transformers engine's LM-head chunk, has no part here: llama.cpp gives every position's logits)."""
        ids = np.asarray(ids, dtype=np.int64)
        llm = None
        n_ctx = max(end - start - 1 for start, end, _ in spans)
        total, count, runs = 0.0, 0, []
        for start, end, first in spans:
            llm = self.llm(n_ctx)
            window = ids[start:end]
            llm.eval(window[:-1].tolist())
            total += _nll(llm.scores[first - 1 : len(window) - 1], window[first:])
            count += len(window) - first
            runs.append((start + first, end))
            if progress is not None:
                progress(end - start - 1)
        return total, count, runs

    def greedy(self, ids: list[int], new_tokens: int, eos: set, done: Any = None) -> list[int]:
        """lm.greedy in llama.cpp: the prompt once, then one token at a time on llama.cpp's KV cache."""
        n_ctx = math.ceil((len(ids) + new_tokens) / DECODE_CTX_STEP) * DECODE_CTX_STEP
        llm = self.llm(n_ctx)
        llm.eval(list(map(int, ids)))
        generated = []
        for _ in range(new_tokens):
            nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            generated.append(nxt)
            if nxt in eos or len(generated) == new_tokens or (done is not None and done(generated)):
                break
            llm.eval([nxt])
        return generated


# The copies a spec is exported to live in a folder of their own under the temporary directory, named EXPORTS + a
# random suffix. Its owner holds a lock on the folder itself for its life (the OS releases it when the process dies,
# killed or not), so a later run tells a killed run's leftovers (about the size of the GGUF file per spec) from a
# live run's, in this container or another one sharing the directory, and removes them.
EXPORTS = "hfpatch-llamacpp-"



def exports_folder(prefix: str = EXPORTS, where: str | None = None) -> tuple[str, int | None]:
    """A new, locked folder for exported copies, named `prefix` + a random suffix under `where` (default: the
    temporary directory): (its path, the descriptor that holds the lock). It is created under a name that
    remove_stale_exports does not look at and renamed once locked, so that no other run ever sees it unlocked."""
    tmp = tempfile.mkdtemp(prefix="." + prefix, dir=where)
    held = _lock_folder(tmp)
    path = os.path.join(os.path.dirname(tmp), os.path.basename(tmp)[1:])
    os.rename(tmp, path)  # the lock is on the folder (its inode), not its name
    return path, held


def remove_stale_exports(where: str | None = None, prefix: str = EXPORTS) -> list[str]:
    """Remove the export folders of runs that ended without removing them (killed): those no process holds locked.
    Returns the folders removed."""
    if fcntl is None:
        return []  # no locks on this system: nothing tells a leftover from a live run's folder
    removed = []
    for path in sorted(glob.glob(os.path.join(where or tempfile.gettempdir(), prefix + "*"))):
        try:
            held = _lock_folder(path)
        except OSError:
            continue  # a live run's (BlockingIOError), or not ours to open
        if held is None:
            continue
        try:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            os.close(held)
    return removed


def _lock_folder(path: str) -> int | None:
    """The descriptor of `path`, locked exclusively (BlockingIOError if another process holds it); None where the
    OS has no such locks."""
    if fcntl is None:
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    return fd


def remove_exports(path: str, held: int | None) -> None:
    shutil.rmtree(path, ignore_errors=True)
    if held is not None:
        with contextlib.suppress(OSError):
            os.close(held)

    # ------------------------------------------------------------------------------------ scoring and decoding

def _nll(logits: np.ndarray, targets: np.ndarray, chunk: int = 256) -> float:
    """Sum of -log softmax(logits)[target] per row, in float64."""
    total = 0.0
    for i in range(0, len(targets), chunk):
        x = logits[i : i + chunk].astype(np.float64)
        m = x.max(axis=1)
        lse = m + np.log(np.exp(x - m[:, None]).sum(axis=1))
        total += float((lse - x[np.arange(len(x)), targets[i : i + chunk]]).sum())
    return total


# ------------------------------------------------------------------------------------------ the sweep's engine

class LlamaCppEngine:
    """What the sweep (sweep.py) calls to check, load, patch and time the model, for llama.cpp."""

    name: ClassVar[str] = NAME
    reads: ClassVar[frozenset[str]] = frozenset()  # none of the sweep's MODEL_OPTIONS (--dtype, --device, ...)
    unread_reason: ClassVar[str] = ("llama.cpp runs the GGUF file's own weight types, on the devices it was built "
                                    "for (those are transformers options)")
    runs_python: ClassVar[bool] = False

    def __init__(self, args: argparse.Namespace) -> None:
        check_installed()
        path = gguf_path(args.model)
        if path is None:
            raise ValueError(f"--engine llama.cpp runs GGUF files; {args.model} is not one (convert it with "
                             "llama.cpp's convert_hf_to_gguf.py)")
        self.path = path

    def check_longest_read(self, args: argparse.Namespace, shape: Any = None) -> None:
        pass  # llama.cpp allocates its context itself and says when it cannot

    def check_memory(self, args: argparse.Namespace, plan: Any, shape: Any = None) -> None:
        pass

    def load(self, args: argparse.Namespace) -> LlamaCppModel:
        return LlamaCppModel(self.path)

    def prepare(self, model: Any, patches: Any, plan: Any, results: Any, name: str) -> LlamaCppModel:
        for spec, kwargs in patches:  # every spec is checked before any work
            with model.applied(kwargs, spec):
                pass
        import llama_cpp

        found = hg.read_patch(self.path)  # the file's own scaling: what `none` runs, and what the specs replace
        loaded = specs.describe_string(specs.request(**found.patch)) if found and found.patch else None
        results.data["model"] = {"name": f"{name} (llama.cpp)", "loaded_with": loaded, "engine": NAME,
                                 "gguf": self.path,
                                 "llama_cpp_python": llama_cpp.__version__, "architecture": model.info.arch,
                                 "trained_window": model.info.window, "threads": model.threads,
                                 "weights": "as stored in the GGUF file"}
        return model

    def estimate(self, ev: Any, run: Any, plan: Any, todo: Any) -> float:
        """Seconds the work left will take, from one timed evaluation (llama.cpp's cost is close to linear in the
        tokens read at these lengths; attention makes long reads slower, so this is a floor)."""
        model = run.model
        n = max(16, min(512, plan.read))
        ids = np.random.default_rng(0).integers(0, 1000, n).tolist()
        llm = model.llm(n)
        t0 = time.perf_counter()
        llm.eval(ids)
        rate = n / (time.perf_counter() - t0)
        units = [u for *_, left in todo for u in left]
        tokens = sum(u.tokens for u in units)
        seconds = tokens / rate
        print(f"{ev.prog}: {budget.work_left(ev.records, todo)} and {tokens:,} tokens to read with "
              f"llama.cpp: about {budget.duration(seconds)} here (from a timed {n}-token evaluation: "
              f"{rate:.0f} tokens/s)", file=sys.stderr)
        return seconds

    @staticmethod
    def applied(model: Any, kwargs: dict, name: str) -> AbstractContextManager:
        return model.applied(kwargs, name)

    @staticmethod
    def paths_ran(model: Any) -> dict:
        """None to record: llama.cpp runs its own attention kernels, whichever the scheme."""
        return {}


_conforms: Callable[[argparse.Namespace], Engine] = LlamaCppEngine  # mypy checks it is an engines.Engine
