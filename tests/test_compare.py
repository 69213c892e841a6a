"""recipes/compare.py and its machinery (recipes/studies/study.py, measure.py, report.py): the study config,
per-block gradient norms against the gradients themselves, the repeated-span recall probe against a model that copies
by construction, the normalisation-statistics measurement, and a whole tiny study (run twice: the second run redoes
nothing)."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO, stdlib_text, tiny_model, tokens

import hfpatch
from hfpatch.train.config import ConfigError
from recipes.studies import measure, study

TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 64}


def study_values(tmp_path, text, **extra):
    return {"study": "t", "pretrain": {"model_config": TINY, "tokenizer": str(tmp_path / "tok"),
                                       "data": {"text_files": [str(text)]}, "seq_len": 64, "batch_size": 2},
            "arms": {"rope": {}, "alibi": {"patch": {"position": "alibi"}}}, "output_dir": str(tmp_path / "out"),
            "evaluate": {"text_files": [str(text)]}, **extra}


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "stdlib.txt"
    path.write_text(stdlib_text(120_000))
    return path


@pytest.mark.parametrize("change,message", [
    (dict(bogus=1), "unknown config key 'bogus'"),
    (dict(arms={}), "arms must name at least one arm"),
    (dict(arms={"x": {"lr": "fast"}}), "arm 'x': lr must be float"),
    (dict(arms={"x": {"patch": {"position": "t6"}}}), "arm 'x': patch: unknown position scheme 't6'"),
    (dict(seeds=[]), "seeds must be a non-empty list"),
    (dict(evaluate={"text_files": ["/no/such.txt"]}), "evaluate.text_files: not found"),
    (dict(evaluate={"passkey": {"arms": ["t5"], "lengths": [64]}}), "names unknown arms ['t5']"),
])
def test_bad_study_configs_are_one_clear_error(tmp_path, text, change, message):
    path = tmp_path / "study.yaml"
    import yaml

    path.write_text(yaml.safe_dump({**study_values(tmp_path, text), **change}))
    with pytest.raises(ConfigError) as e:
        study.plan(study.load_study(str(path), []))
    assert message in str(e.value)


def test_arms_differ_only_by_their_overrides(tmp_path, text):
    import yaml

    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study_values(tmp_path, text, seeds=[0, 1]), sort_keys=False))
    runs = study.plan(study.load_study(str(path), ["pretrain.max_steps=7", "arms.alibi.lr=0.01"]))
    assert [r.name for r in runs] == ["rope/seed0", "rope/seed1", "alibi/seed0", "alibi/seed1"]
    a, b = runs[0].cfg.as_dict(), runs[2].cfg.as_dict()
    differ = sorted(k for k in a if a[k] != b[k])
    assert differ == ["lr", "output_dir", "patch"] and a["max_steps"] == b["max_steps"] == 7
    assert runs[2].cfg.patch == {"position": "alibi"} and runs[1].cfg.seed == 1


def test_grad_norms_are_the_norms_of_the_accumulated_gradients(tmp_path):
    model = tiny_model("llama").train()
    rec = measure.GradNorms(model, tmp_path / "g.jsonl", first_step=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    try:
        for _ in range(2):  # two micro-batches accumulate into one step
            model(tokens(20, batch=2), labels=tokens(20, batch=2)).loss.backward()
        want = {}
        for name, p in model.named_parameters():
            group = ("layer." + name.split(".")[2] if name.startswith("model.layers.")
                     else "embedding" if p is model.get_input_embeddings().weight else "final")
            want[group] = want.get(group, 0.0) + float(p.grad.pow(2).sum())
        opt.step()
    finally:
        rec.close()
    [row] = measure.read_jsonl(tmp_path / "g.jsonl")
    assert row["step"] == 1 and set(row) - {"step"} == set(want) == {"embedding", "layer.0", "layer.1", "final"}
    assert all(abs(row[g] - want[g] ** 0.5) < 1e-5 * max(1.0, want[g] ** 0.5) for g in want)
    opt.step()  # after close, nothing more is recorded
    assert len(measure.read_jsonl(tmp_path / "g.jsonl")) == 1


class Copier(torch.nn.Module):
    """Predicts the token that followed the previous occurrence of the current token, if it lies at most `reach`
    tokens back; otherwise nothing (uniform)."""

    def __init__(self, vocab, reach):
        super().__init__()
        self.vocab, self.reach = vocab, reach

    def forward(self, input_ids, use_cache=False):
        b, n = input_ids.shape
        t, s = torch.arange(n)[:, None], torch.arange(n)[None, :]
        same = (input_ids[:, :, None] == input_ids[:, None, :]) & (s < t) & (t - s <= self.reach)
        last = torch.where(same, s, -1).max(-1).values  # [b, n]: the nearest earlier occurrence, -1 if none
        logits = torch.zeros(b, n, self.vocab)
        i, j = torch.nonzero(last >= 0, as_tuple=True)
        logits[i, j, input_ids[i, last[i, j] + 1]] = 20.0
        return SimpleNamespace(logits=logits)


def test_recall_gain_measures_how_far_the_model_copies():
    g = torch.Generator().manual_seed(0)
    ids = torch.randperm(5000, generator=g)[:3000]  # held-out text with no repeats
    result = measure.recall(Copier(5000, reach=100), ids, [8, 40, 200], span=8, trials=3, limit=300)
    assert result["8"]["gain"] > 5 and result["40"]["gain"] > 5  # the copy is within reach
    assert abs(result["200"]["gain"]) < 1e-6  # 200 + 8 tokens back: out of reach, nothing recalled
    assert measure.recall(Copier(5000, 100), ids, [400], span=8, trials=1, limit=300)["400"]["skipped"]


def test_statistics_effect_only_moves_batch_norms():
    ids = tokens(64 * 8, seed=3)[0]
    ln = tiny_model("llama")
    nll = measure.statistics_effect(ln, ids, 64, 4)["nll"]
    assert max(nll.values()) - min(nll.values()) < 1e-5
    bn = hfpatch.patch(tiny_model("llama"), norm="batchnorm").train()
    with torch.no_grad():
        for s in range(3):
            bn(tokens(64, batch=4, seed=s))
    nll = measure.statistics_effect(bn, ids, 64, 4)["nll"]
    assert abs(nll["running_batch1"] - nll["running_batch4"]) < 1e-5  # running statistics: the batch does not matter
    assert abs(nll["batchstats_batch1"] - nll["running_batch1"]) > 1e-3
    assert abs(nll["batchstats_batch1"] - nll["batchstats_batch4"]) > 1e-4


def test_a_whole_study_and_its_rerun(tmp_path, tiny_tokenizer_dir, text):
    """Two arms (one with a learned table shorter than the longest length), trained 3 steps, evaluated; the second
    invocation trains and scores nothing again and writes the same results."""
    overrides = [f"output_dir={tmp_path / 'out'}", f"pretrain.tokenizer={tiny_tokenizer_dir}",
                 f"pretrain.model_config={json.dumps(TINY)}", f"pretrain.data.text_files=[{text}]",
                 "pretrain.seq_len=32", "pretrain.batch_size=2", "pretrain.max_steps=3", "pretrain.eval_every=3",
                 "pretrain.save_every=3", "pretrain.warmup_steps=1",
                 "arms={rope: {}, learned: {patch: {position: learned, table_size: 48}}}",
                 f"evaluate={{text_files: [{text}], tokens_per_doc: 1024, lengths: [32, 64], grad_norms: true, "
                 "batch_statistics: true, step_time_rounds: 1, recall: {distances: [8, 40], span: 8, trials: 2}}"]
    cmd = [sys.executable, str(REPO / "recipes" / "compare.py"), "--config",
           str(REPO / "recipes" / "configs" / "compare_positions.yaml"), *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "out"
    summary = json.loads((out / "compare_positions.json").read_text())
    assert (out / "compare_positions.png").stat().st_size > 0
    assert "| rope |" in (out / "compare_positions.md").read_text()
    rope, learned = summary["runs"]
    assert set(rope["ppl"]) == {"32", "64"} and set(learned["ppl"]) == {"32"}
    assert learned["refused_lengths"] == {"64": "past the learned table's 48 rows"}
    assert learned["recall"]["40"]["skipped"] and "gain" in rope["recall"]["40"]
    assert learned["applied"] == {"position": {"scheme": "learned", "table_size": 48}}
    assert len(rope["training"]["loss"]) == 3 and [r["step"] for r in rope["grad_norms"]["steps"]] == [1, 2, 3]
    assert set(rope["grad_norms"]["init"]) == {"embedding", "layer.0", "layer.1", "final"}
    assert "recipes/pretrain.py" in rope["command"] and "patch=" not in rope["command"]
    assert "'patch={position: learned, table_size: 48}'" in learned["command"]
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "train:" not in again.stderr  # nothing trained again
    second = json.loads((out / "compare_positions.json").read_text())
    for a, b in zip(summary["runs"], second["runs"]):
        assert a["ppl"] == b["ppl"] and a["training"]["loss"] == b["training"]["loss"]
    assert set(second["step_time"]["seconds"]) == {"rope", "learned"}
    bad = subprocess.run([*cmd, "seeds=oops"], capture_output=True, text=True, cwd=REPO, env=env)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("compare: error: seeds must be")
    changed = subprocess.run([*cmd, "pretrain.lr=0.01"], capture_output=True, text=True, cwd=REPO, env=env)
    assert changed.returncode == 2 and "holds a run made with other settings (lr=" in changed.stderr
