"""The evaluation loop runs any engine, not only transformers: an engine whose model is its own object (as
llama.cpp's is), scoring and decoding with its own code and applying patch specs its own way, goes through the same
sweep — checks, estimate, cells, resume — and nothing of transformers or of hfpatch's patching is called on its model.
Engines are registered from here, outside the package, through hfpatch.evaluate.engines.register, the one registry
that --engine's choices and help, the sweep, the Python API and the docs' table read. These run without
llama-cpp-python; tests/test_gguf_llamacpp.py runs the real llama.cpp engine."""

from __future__ import annotations

import contextlib
import json
from typing import ClassVar

import pytest
from conftest import stdlib_text

import hfpatch.evaluate
from hfpatch.evaluate import definition, engines, evaluation, sweep
from hfpatch.evaluate.common import load_model
from hfpatch.evaluate.transformers_engine import TransformersEngine
from hfpatch.lm.causal import causal_lm_parts, document_nll, greedy
from hfpatch.registry import Registry
from hfpatch.tiny import save_sized as save_tiny


# --8<-- [start:engine]
class ForeignModel:
    """Another engine's model: it scores and decodes with a transformers model it keeps to itself, and records the
    specs it was asked to run. Any attribute a transformers model has is missing here."""

    def __init__(self, model):
        self._parts = causal_lm_parts(model)
        self.applied_specs: list[str] = []

    def document_nll(self, ids, spans, chunk=1024, progress=None):
        return document_nll(self._parts, ids, spans, chunk, progress)

    def greedy(self, ids, new_tokens, eos, done=None):
        return greedy(self._parts, ids, new_tokens, eos, done)


class ForeignEngine:
    """engines.Engine, implemented without transformers' model object."""

    name: ClassVar[str] = "foreign"
    reads: ClassVar[frozenset[str]] = frozenset(sweep.MODEL_OPTIONS)  # it loads through transformers
    unread_reason: ClassVar[str] = ""
    runs_python: ClassVar[bool] = False
    loaded: ClassVar[list[ForeignModel]] = []

    def __init__(self, args):
        pass

    def check_longest_read(self, args, shape=None) -> None:
        pass

    def check_memory(self, args, plan, shape=None) -> None:
        pass

    def load(self, args):
        model = ForeignModel(load_model(args))
        ForeignEngine.loaded.append(model)
        return model

    def prepare(self, model, patches, plan, results, name):
        results.data["model"] = {"name": f"{name} (foreign)", "engine": self.name}
        return model

    def estimate(self, ev, run, plan, todo) -> float:
        return 0.0

    @staticmethod
    @contextlib.contextmanager
    def applied(model, kwargs, name):
        model.applied_specs.append(name)
        yield

    @staticmethod
    def paths_ran(model) -> dict:
        return {}
# --8<-- [end:engine]


class CountingEngine(TransformersEngine):
    """The transformers engine, wrapped: it counts the scorers it prepares and runs the model as transformers does."""

    name: ClassVar[str] = "counting"
    prepared: ClassVar[int] = 0

    def prepare(self, model, patches, plan, results, name):
        CountingEngine.prepared += 1
        return super().prepare(model, patches, plan, results, name)


@pytest.fixture
def registry(monkeypatch):
    """ENGINES as the package registers it, for this test only: a registry takes each name once, for good, and an
    engine registered here must not stay registered for the other tests."""
    monkeypatch.setattr(engines, "ENGINES", Registry.of("evaluation engine", dict(engines.ENGINES)))
    return engines.ENGINES


@pytest.fixture
def foreign(registry):
    engines.register("foreign", ForeignEngine, "a model of its own, scored and decoded by its own code")
    ForeignEngine.loaded = []
    return ForeignEngine


def engine_option(name: str = "ppl"):
    """--engine as the evaluation's parser declares it."""
    return next(a for a in definition.build_parser(evaluation(name))._actions if a.dest == "engine")


def test_every_registered_engine_is_a_command_line_choice_with_its_help():
    """--engine's choices, default and help are the registry's, read off the parser an evaluation builds."""
    action = engine_option()
    assert action.choices == list(engines.ENGINES) == ["transformers", "llama.cpp", "vllm"]
    assert action.default == engines.DEFAULT
    assert all(f"{r.name}{' (default)' if r.name == engines.DEFAULT else ''}: {r.summary}" in action.help
               for r in engines.ENGINES.values())


@pytest.mark.parametrize("name", ["transformers", "llama.cpp", "vllm"])
def test_hfpatchs_engines_load_as_classes_with_every_member_of_the_protocol(name):
    cls = engines.engine_class(name)  # imported now: the registry names its module, so --help imports none
    assert cls.name == name
    assert not [m for m in engines.MEMBERS if not hasattr(cls, m)]
    assert set(engines.MEMBERS) == {"name", "reads", "unread_reason", "runs_python", "check_longest_read",
                                    "check_memory", "load", "prepare", "estimate", "applied", "paths_ran"}


def test_an_engine_registered_from_outside_is_offered_with_its_help(foreign):
    action = engine_option("passkey")
    assert action.choices[-1] == "foreign" and "foreign: a model of its own" in action.help
    assert engines.engine_class("foreign") is ForeignEngine


def test_registering_what_is_not_an_engine_is_one_clear_error(registry):
    class Bare:
        name = "bare"

    with pytest.raises(TypeError, match="an engine is a class"):
        engines.register("obj", ForeignEngine(None), "an instance, not a class")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"Bare lacks applied, check_longest_read, .* of the Engine protocol"):
        engines.register("bare", Bare, "no member but its name")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="its class ForeignEngine is named 'foreign'; register it under its own"):
        engines.register("other", ForeignEngine, "registered under another name")
    with pytest.raises(ValueError, match="evaluation engine 'vllm' is registered twice"):
        engines.register("vllm", "x.y:Z", "a second vllm")
    with pytest.raises(ValueError, match=r"'x\.Y' is not 'package\.module:Class'"):
        engines.register("dotted", "x.Y", "a path without its class")
    assert list(registry) == ["transformers", "llama.cpp", "vllm"]  # none of them registered


def test_an_engine_no_one_registered_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"unknown evaluation engine 'nope'; available: transformers, llama\.cpp, vl"):
        engines.engine_class("nope")
    with pytest.raises(ValueError, match=r"engine must be one of transformers, llama\.cpp, vllm; got 'nope'"):
        hfpatch.evaluate.run("ppl", str(tmp_path / "model"), engine="nope")


def test_ppl_runs_in_an_engine_that_wraps_the_transformers_one_with_its_numbers(registry, tmp_path, monkeypatch):
    """An engine registered from outside runs through the Python API: the same cells, the same numbers as
    transformers, and its name in the results' identity."""
    monkeypatch.setenv("HFPATCH_CACHE", str(tmp_path / "cache"))
    engines.register("counting", CountingEngine, "the transformers engine, counting what it prepares")
    CountingEngine.prepared = 0
    model_dir = save_tiny(tmp_path / "model")
    text = tmp_path / "text.txt"
    text.write_text(stdlib_text(20_000))
    settings = {"lengths": "64", "text_files": [str(text)], "tokens_per_doc": "128", "patches": "none,yarn:2"}
    tf = hfpatch.evaluate.run("ppl", str(model_dir), **settings)
    wrapped = hfpatch.evaluate.run("ppl", str(model_dir), engine="counting", **settings)
    assert CountingEngine.prepared == 1
    assert wrapped["identity"]["engine"] == "counting" and "engine" not in tf["identity"]
    assert [c["patch"] for c in wrapped["cells"]] == ["none", "yarn:2"]
    for ours, theirs in zip(wrapped["cells"], tf["cells"]):
        assert ours["mean_nll"] == theirs["mean_nll"]  # the same model, the same tokens, the same code


def test_ppl_runs_in_another_engine_with_the_numbers_of_its_own_scoring(foreign, tmp_path, monkeypatch):
    monkeypatch.setenv("HFPATCH_CACHE", str(tmp_path / "cache"))
    model_dir = save_tiny(tmp_path / "model")
    text = tmp_path / "text.txt"
    text.write_text(stdlib_text(20_000))
    args = ["--model", str(model_dir), "--lengths", "64", "--text-files", str(text), "--tokens-per-doc", "128",
            "--no-plot"]
    assert evaluation("ppl").main([*args, "--patches", "none", "--out", str(tmp_path / "tf")]) == 0
    assert evaluation("ppl").main([*args, "--patches", "none,yarn:2", "--engine", "foreign",
                                   "--out", str(tmp_path / "foreign")]) == 0
    (model,) = foreign.loaded
    assert model.applied_specs == ["none", "yarn:2"]  # the engine applied each spec, once, its own way
    tf, other = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("tf", "foreign"))
    assert other["identity"]["engine"] == "foreign"
    assert all(c["complete"] for c in other["cells"]) and "attention_path" not in other["cells"][0]
    # its scoring runs the same model on the same tokens: the same numbers as the transformers engine's
    assert other["cells"][0]["mean_nll"] == pytest.approx(tf["cells"][0]["mean_nll"], rel=1e-6)


def test_passkey_decodes_with_the_engine_own_greedy(foreign, tmp_path):
    model_dir = save_tiny(tmp_path / "model")
    argv = ["--model", str(model_dir), "--lengths", "600", "--depths", "0.5", "--trials", "1", "--patches", "none",
            "--engine", "foreign", "--out", str(tmp_path / "pk"), "--no-plot"]
    assert evaluation("passkey").main(argv) == 0
    (model,) = foreign.loaded
    assert model.applied_specs == ["none"]
    (cell,) = json.loads((tmp_path / "pk" / "results.json").read_text())["cells"]
    assert cell["complete"] and len(cell["trials"]) == 1


@pytest.mark.parametrize("flag", [["--dtype", "bf16"], ["--dtype", "fp32"], ["--device", "cpu"],
                                  ["--device-map", "auto"]])
def test_llama_cpp_refuses_the_transformers_options_it_would_ignore(tmp_path, capsys, flag):
    """llama.cpp runs the GGUF's own types where it was built: --dtype and the device options are refused (exit 2,
    one line) before anything loads (so without llama-cpp-python too), not recorded as if they had run."""
    out = tmp_path / "out"
    assert evaluation("ppl").main(["--model", str(tmp_path / "x.gguf"), "--engine", "llama.cpp", *flag,
                                   "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag[0] in err and "GGUF file's own weight types" in err
    assert not out.exists()


def test_stale_llama_cpp_exports_are_removed_and_live_ones_kept(tmp_path, monkeypatch):
    """A killed llama.cpp run leaves its exported copies behind: the next run removes them, never a live run's."""
    import os
    import signal
    import subprocess
    import sys
    import tempfile

    from hfpatch.evaluate import llamacpp

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    code = ("import sys, time; from hfpatch.evaluate.llamacpp import exports_folder; "
            "p, _ = exports_folder(); open(p + '/spec0.gguf', 'w').write('x'); print(p, flush=True); time.sleep(60)")
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    held = None
    try:
        killed, live = (p.stdout.readline().strip() for p in procs)
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait()
        mine, held = llamacpp.exports_folder()  # this process's own, held
        assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p) for p in (killed, live, mine))
        assert llamacpp.remove_stale_exports() == [killed]
        assert os.path.isdir(live) and os.path.isdir(mine) and not os.path.exists(killed)
    finally:
        for p in procs:
            p.kill()
            p.wait()
        if held is not None:
            os.close(held)
