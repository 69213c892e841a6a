"""The lm-evaluation-harness bridge, offline: a local task (rolling loglikelihood over local documents) scored by
lm-eval's own `hf` model and by `--model hfpatch` gives the same numbers; `hfpatch eval ppl --windowing rolling`
scores the same tokens as lm-eval's rolling windows and agrees with its bits per byte and word perplexity; the
`hfpatch lm-eval` command; errors."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest

pytest.importorskip("lm_eval",
                    reason="the lm-eval bridge tests need the optional extra: pip install 'hfpatch[lm-eval]'")

import lm_eval
from lm_eval.tasks import TaskManager
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from hfpatch.cli import main as cli_main
from hfpatch.evaluate import harness  # noqa: F401 - registers "hfpatch" for lm_eval.simple_evaluate
from hfpatch.lm.causal import windows
from hfpatch.tiny import char_text as text_of
from hfpatch.tiny import char_tokenizer as tiny_tokenizer
from hfpatch.tiny import save_sized as save_tiny

TASK = "hfpatch_local_text"
LENGTH = 48


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """A tiny saved model, and a local lm-eval task over two documents (also as .txt files for eval ppl)."""
    base = tmp_path_factory.mktemp("harness")
    model = save_tiny(base / "model")
    docs = [text_of(230, 11).strip(), text_of(170, 12).strip()]  # no trailing newline: lm-eval's Jinja drops it
    (base / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (base / "txt").mkdir()
    for i, d in enumerate(docs):
        (base / "txt" / f"d{i}.txt").write_text(d, encoding="utf-8")
    (base / "task").mkdir()
    (base / "task" / "local.yaml").write_text(
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {base / 'docs.jsonl'}\n"
        "test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n")
    return base, model, docs


def _lm_eval(model_name, model_args, base):
    r = lm_eval.simple_evaluate(model=model_name, model_args=model_args, tasks=[TASK], device="cpu", batch_size=1,
                                task_manager=TaskManager(include_path=str(base / "task")))
    res = r["results"][TASK]
    return {k.split(",")[0]: v for k, v in res.items() if k.endswith(",none") and "stderr" not in k}


def test_rolling_windows_are_lm_evals(local):
    """windows(..., "rolling") over [prefix] + tokens reads and scores exactly what lm-eval's rolling windows do:
    the same input tokens for each window and the same predicted tokens, every token once."""
    for n, length in ((100, 48), (96, 48), (48, 48), (30, 48), (1000, 7), (50, 1)):
        tokens = list(range(1000, 1000 + n))
        seq = [7, *tokens]  # 7 = the prefix token
        theirs = [make_disjoint_window(w) for w in get_rolling_token_windows(tokens, 7, length, 1)]
        if n < length or length < 2:
            continue  # eval ppl needs documents of at least `length` tokens and windows of at least 2
        ours = windows(len(seq), length, "rolling")
        assert len(ours) == len(theirs)
        for (start, end, first), (context, pred) in zip(ours, theirs):
            assert seq[start + first:end] == pred  # the same predicted tokens ...
            read = seq[start:end - 1]  # ... from the same input (lm-eval: context + pred[:-1], at most `length`)
            assert read[-length:] == (context + pred)[:-1][-length:] and len(read) <= length


@pytest.fixture(scope="module")
def scored(local):
    """lm-eval's numbers for the local task: its own hf model, and the bridge with patch=none and yarn:2."""
    base, model, _ = local
    return {"hf": _lm_eval("hf", f"pretrained={model},dtype=float32,max_length={LENGTH}", base),
            **{p: _lm_eval("hfpatch", f"pretrained={model},patch={p},max_length={LENGTH}", base)
               for p in ("none", "yarn:2")}}


def test_bridge_equals_lm_evals_hf_model(scored):
    assert scored["none"] == scored["hf"] and set(scored["hf"]) == {"word_perplexity", "byte_perplexity",
                                                                   "bits_per_byte"}
    assert scored["yarn:2"]["bits_per_byte"] != scored["hf"]["bits_per_byte"]  # the patch is applied


@pytest.mark.parametrize("patch", ["none", "yarn:2"])
def test_eval_ppl_rolling_agrees_with_lm_eval(local, scored, tmp_path, monkeypatch, patch):
    """The same tokens scored the same way: lm-eval's rolling windows (every token, the first from a prefix token
    — here BOS) and eval ppl --windowing rolling; bits per byte and word perplexity agree to float rounding."""
    base, model, docs = local
    monkeypatch.setenv("HFPATCH_CACHE", str(tmp_path / "cache"))
    theirs = scored[patch]
    assert cli_main(["eval", "ppl", "--model", str(model), "--text-files", str(base / "txt"), "--lengths",
                     str(LENGTH), "--windowing", "rolling", "--patches", patch, "--no-plot",
                     "--out", str(tmp_path / "o")]) == 0
    (cell,) = json.loads((tmp_path / "o" / "results.json").read_text())["cells"]
    assert cell["prefix_token"] == tiny_tokenizer().bos_token_id
    assert cell["tokens"] == sum(len(d) for d in docs)  # one token per character: every token was scored
    assert cell["bytes"] == sum(len(d.encode("utf-8")) for d in docs)
    words = sum(len(re.split(r"\s+", d)) for d in docs)  # lm-eval's word count
    assert cell["bpb"] == pytest.approx(theirs["bits_per_byte"], rel=1e-6)
    assert math.exp(cell["nll_sum"] / words) == pytest.approx(theirs["word_perplexity"], rel=1e-5)


def test_hfpatch_lm_eval_command(local, tmp_path, capsys):
    base, model, _ = local
    out = tmp_path / "lm"
    assert cli_main(["lm-eval", "--model", "hfpatch", "--model_args", f"pretrained={model},patch=ntk:2,max_length=32",
                     "--tasks", TASK, "--include_path", str(base / "task"), "--device", "cpu",
                     "--output_path", str(out)]) == 0
    (written,) = out.rglob("results_*.json")
    data = json.loads(written.read_text())
    assert data["results"][TASK]["bits_per_byte,none"] > 0
    assert data["config"]["model"] == "hfpatch" and data["config"]["model_args"]["patch"] == "ntk:2"
    capsys.readouterr()
    assert cli_main(["lm-eval", "--model", "hfpatch", "--model_args", f"pretrained={model},patch=yarm:2",
                     "--tasks", TASK, "--include_path", str(base / "task"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("hfpatch lm-eval: error:") and "unknown position scheme 'yarm'" in err


# In a fresh process: the `hfpatch lm-eval` command registers the model by name, and lm-eval's first request for it
# imports the bridge (with torch), which takes the name over with its class.
REGISTERED_BY_NAME = r"""
import sys
from hfpatch.evaluate import lm_eval_command
lm_eval_command.register()
before = "torch" in sys.modules
from lm_eval.api.registry import get_model
found = get_model("hfpatch")
print(before, f"{found.__module__}:{found.__name__}")
"""


def test_the_command_registers_the_bridge_by_name_and_lm_eval_imports_it_when_asked():
    done = subprocess.run([sys.executable, "-c", REGISTERED_BY_NAME], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["False", "hfpatch.evaluate.harness:HFPatchLM"]


def test_without_lm_eval_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval.__main__", None)  # as where the extra is not installed: ImportError
    assert cli_main(["lm-eval", "--model", "hfpatch"]) == 2
    assert "pip install 'hfpatch[lm-eval]'" in capsys.readouterr().err


def test_hfpatch_lm_eval_passes_metadata_to_the_task(local, tmp_path, monkeypatch):
    """--metadata reaches the task as lm-eval's long-context tasks read it (RULER: max_seq_lengths, tokenizer): a
    local task that synthesizes one document per requested length, as they do, and records what it was given."""
    _, model, _ = local
    (tmp_path / "task").mkdir()
    (tmp_path / "task" / "lengths.py").write_text(
        "import json, os\nimport datasets\n\n"
        "def docs(**kwargs):\n"
        "    with open(os.environ['HFPATCH_TEST_METADATA'], 'w') as f:\n"
        "        json.dump({k: v for k, v in kwargs.items() if k in ('max_seq_lengths', 'tokenizer')}, f)\n"
        "    rows = [{'text': 'ab ' * (n // 3)} for n in kwargs['max_seq_lengths']]\n"
        "    return {'test': datasets.Dataset.from_list(rows)}\n")
    (tmp_path / "task" / "lengths.yaml").write_text(
        "task: hfpatch_lengths\ndataset_path: ''\ndataset_name: ''\ncustom_dataset: !function lengths.docs\n"
        "test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: bits_per_byte\n")
    monkeypatch.setenv("HFPATCH_TEST_METADATA", str(tmp_path / "given.json"))
    out = tmp_path / "lm"
    assert cli_main(["lm-eval", "--model", "hfpatch", "--model_args", f"pretrained={model},patch=yarn:2",
                     "--tasks", "hfpatch_lengths", "--include_path", str(tmp_path / "task"), "--device", "cpu",
                     "--metadata", json.dumps({"max_seq_lengths": [30, 90], "tokenizer": str(model)}),
                     "--output_path", str(out)]) == 0
    assert json.loads((tmp_path / "given.json").read_text()) == {"max_seq_lengths": [30, 90], "tokenizer": str(model)}
    (written,) = out.rglob("results_*.json")
    assert json.loads(written.read_text())["n-samples"]["hfpatch_lengths"]["effective"] == 2
