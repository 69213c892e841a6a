"""The evaluation loop runs any engine, not only transformers: an engine whose model is its own object (as
llama.cpp's is), scoring and decoding with its own code and applying patch specs its own way, goes through the same
sweep — checks, estimate, cells, resume — and nothing of transformers or of hfpatch's patching is called on its model.
These run without llama-cpp-python; tests/test_gguf_llamacpp.py runs the real llama.cpp engine."""

from __future__ import annotations

import contextlib
import json
from typing import ClassVar

import pytest
from conftest import stdlib_text

from hfpatch.evaluate import definition, evaluation, sweep
from hfpatch.evaluate.common import load_model
from hfpatch.lm.causal import causal_lm_parts, document_nll, greedy
from hfpatch.registry import Registry
from hfpatch.tiny import save_sized as save_tiny


class ForeignModel:
    """Another engine's model: it scores and decodes with a transformers model it keeps to itself, and records the
    specs it was asked to run. Any attribute a transformers model has is missing here."""

    def __init__(self, model):
        self._parts = causal_lm_parts(model)
        self.applied_specs: list[str] = []

    def document_nll(self, ids, spans, progress=None):
        return document_nll(self._parts, ids, spans, progress=progress)

    def greedy(self, ids, new_tokens, eos, done=None):
        return greedy(self._parts, ids, new_tokens, eos, done)


class ForeignEngine:
    """The engine protocol of sweep.ENGINES, implemented without transformers' model object."""

    name = "foreign"
    reads = frozenset(sweep.MODEL_OPTIONS)  # it loads through transformers
    unread_reason = ""
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


def test_the_engines_the_command_line_offers_are_the_sweeps_engines():
    """--engine's choices are declared where the evaluations' command line is (definition.py, which loads no
    engine, so that --help answers without torch): the sweep's registry holds exactly those engines, by their names."""
    assert tuple(sweep.ENGINES) == definition.ENGINE_NAMES
    assert all(sweep.ENGINES[name].name == name for name in definition.ENGINE_NAMES)


@pytest.fixture
def foreign(monkeypatch):
    # the registry with one more engine, for this test only (a registry takes each name once, for good)
    monkeypatch.setattr(sweep, "ENGINES", Registry.of("evaluation engine", {**sweep.ENGINES, "foreign": ForeignEngine}))
    monkeypatch.setattr(definition, "ENGINE_NAMES", (*definition.ENGINE_NAMES, "foreign"))  # --engine's choices
    ForeignEngine.loaded = []
    return ForeignEngine


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
