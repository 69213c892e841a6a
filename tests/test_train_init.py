"""The pretrain recipe's `init:` switch (hfpatch/train/init.py) and `adam_beta2`, and the compare study's grid of arms
and its reports (study.grid_arms, study_report's sweep and first-step tables, measure.unigram_loss).

init="paper" is checked against the formulas it claims (Glorot's std sqrt(2 / (fan_in + fan_out)) and bound
sqrt(6 / (fan_in + fan_out)), the embedding's N(0, d^-1/2) and its output times sqrt(d)), each of which
transformers' own init (N(0, 0.02), unscaled) fails."""

import json
import math

import pytest
import torch
import yaml
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

import hfpatch
from hfpatch.train import config, init, loop, setup
from hfpatch.train.config import ConfigError
from recipes.studies import measure, study
from recipes.studies import report as study_report

SIZES = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "vocab_size": 1000,
         "tie_word_embeddings": True, "pad_token_id": 0}


def build(which: str, seed: int = 0):
    torch.manual_seed(seed)
    options = dict(SIZES)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(options.pop("model_type"), **options))
    return init.apply(model, which)


def linears(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)
            and m.weight is not model.get_input_embeddings().weight]


@pytest.mark.parametrize("which", ["paper", "hf"])
def test_paper_init_draws_every_linear_with_glorot_std(which):
    """Each linear weight's sample std within 4 standard errors (std / sqrt(2n)) of sqrt(2 / (fan_in + fan_out)),
    and inside the uniform bound; transformers' N(0, 0.02) is far from both for these shapes."""
    model = build(which)
    assert len(linears(model)) == 2 * 7  # q, k, v, o, gate, up, down per block; the tied head is the embedding
    for name, m in linears(model):
        fan_out, fan_in = m.weight.shape
        want = math.sqrt(2 / (fan_in + fan_out))
        got = m.weight.std().item()
        close = abs(got - want) < 4 * want / math.sqrt(2 * m.weight.numel())
        bounded = m.weight.abs().max().item() <= math.sqrt(6 / (fan_in + fan_out))
        assert (close and bounded) == (which == "paper"), (name, got, want)


def test_paper_embedding_is_scaled_by_sqrt_d_at_the_input_and_not_at_the_tied_head():
    model = build("paper")
    emb, d = model.get_input_embeddings(), SIZES["hidden_size"]
    w = emb.weight.detach()
    assert abs(w[1:].std().item() - d ** -0.5) < 4 * d ** -0.5 / math.sqrt(2 * w[1:].numel())
    assert torch.count_nonzero(w[SIZES["pad_token_id"]]) == 0
    ids = torch.tensor([[5, 17, 999, 0]])
    torch.testing.assert_close(emb(ids), nn.functional.embedding(ids, w) * math.sqrt(d), rtol=0, atol=0)
    assert model.config.hfpatch_embedding_scale == math.sqrt(d)
    # the tied head reads the table itself: logits = final hidden state x W^T
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state
        torch.testing.assert_close(model(input_ids=ids).logits, hidden @ w.T)
    hf = build("hf")
    hf_emb = hf.get_input_embeddings()
    torch.testing.assert_close(hf_emb(ids), nn.functional.embedding(ids, hf_emb.weight.detach()), rtol=0, atol=0)
    assert abs(hf_emb.weight.std().item() - 0.02) < 1e-3 and not hasattr(hf.config, init.SCALE_CONFIG_KEY)


def test_a_saved_paper_model_gets_its_embedding_scale_back_with_restore(tmp_path):
    model = build("paper").eval()
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        want = model(input_ids=ids).logits
    hfpatch.save_pretrained(model, tmp_path / "m")
    loaded, _ = hfpatch.models.load(str(tmp_path / "m"), tokenizer=False)
    with torch.no_grad():
        assert not torch.allclose(loaded(input_ids=ids).logits, want, atol=1e-4)  # loaded without the scale
        torch.testing.assert_close(init.restore(loaded)(input_ids=ids).logits, want)


def test_bad_init_is_refused():
    with pytest.raises(ValueError, match="init must be one of hf, paper; got 'xavier'"):
        build("xavier")


def pretrain_cfg(tmp_path, *overrides):
    tok = tmp_path / "tok"
    tok.mkdir(exist_ok=True)
    model = {k: v for k, v in SIZES.items() if k not in ("vocab_size", "pad_token_id")}
    return config.load("pretrain", None, [f"model_config={model}", f"tokenizer={tok}", f"output_dir={tmp_path}/o",
                                          *overrides])


@pytest.mark.parametrize("override,message", [
    ("init=xavier", "init must be one of hf, paper; got 'xavier'"),
    ("adam_beta2=1.0", "adam_beta2 must be a number in [0, 1), got 1.0"),
])
def test_bad_init_or_beta2_in_a_config_is_one_clear_error(tmp_path, override, message):
    with pytest.raises(ConfigError) as e:
        pretrain_cfg(tmp_path, override)
    assert message in str(e.value)


def test_the_config_reaches_the_model_and_the_optimizer(tmp_path):
    tok = type("Tok", (), {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "__len__": lambda self: 1000})()
    cfg = pretrain_cfg(tmp_path, "init=paper", "adam_beta2=0.98")
    model = setup.from_config(cfg, tok)
    assert model.get_input_embeddings().hfpatch_embedding_scale == math.sqrt(SIZES["hidden_size"])
    run = loop.prepare(cfg, model)
    try:
        assert run.optimizer.param_groups[0]["betas"] == (0.9, 0.98)
    finally:
        loop.finish(run)
    plain = setup.from_config(pretrain_cfg(tmp_path), tok)
    assert not isinstance(plain.get_input_embeddings(), init.ScaledEmbedding)


# ------------------------------------------------------------------------------------------------ the study grid

GRID = {"init": {"hf": {}, "paper": {"init": "paper"}}, "lr": {"1e-3": {}, "1e-2": {"lr": 1.0e-2}}}


def test_grid_arms_are_every_combination_with_their_overrides_merged():
    arms = study.grid_arms(GRID)
    assert list(arms) == ["hf-1e-3", "hf-1e-2", "paper-1e-3", "paper-1e-2"]
    assert arms["paper-1e-2"] == ({"init": "paper", "lr": "1e-2"}, {"init": "paper", "lr": 1.0e-2})
    assert study.grid_arms({}) == {}
    with pytest.raises(ConfigError, match=r"grid\.b\.y sets lr, which another axis sets too"):
        study.grid_arms({"a": {"x": {"lr": 0.1}}, "b": {"y": {"lr": 0.2}}})
    with pytest.raises(ConfigError, match=r"grid\.a must map each label to a mapping"):
        study.grid_arms({"a": [1, 2]})


def study_file(tmp_path, **extra):
    tok = tmp_path / "tok"
    tok.mkdir(exist_ok=True)
    text = tmp_path / "t.txt"
    text.write_text("some text " * 100)
    model = {k: v for k, v in SIZES.items() if k not in ("vocab_size", "pad_token_id")}
    values = {"study": "g", "pretrain": {"model_config": model, "tokenizer": str(tok),
                                         "data": {"text_files": [str(text)]}},
              "grid": GRID, "output_dir": str(tmp_path / "out"), **extra}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(values, sort_keys=False))
    return path, text


def test_a_grid_study_plans_one_run_per_combination(tmp_path):
    path, _ = study_file(tmp_path)
    runs = study.plan(study.load_study(str(path), []))
    assert [r.arm for r in runs] == ["hf-1e-3", "hf-1e-2", "paper-1e-3", "paper-1e-2"]
    assert [(r.cfg.init, r.cfg.lr) for r in runs] == [("hf", 1e-4), ("hf", 1e-2), ("paper", 1e-4), ("paper", 1e-2)]


def test_paper_arms_refuse_the_evaluations_that_reload_without_the_scale(tmp_path):
    path, text = study_file(tmp_path)
    with pytest.raises(ConfigError, match="arm 'paper-1e-3': init=paper scales the embedding output"):
        study.plan(study.load_study(str(path), [f"evaluate.text_files=[{text}]"]))


def fake_run(arm, grads, final, diverged=False):
    return {"arm": arm, "seed": 0, "training": {"final_loss": final, "diverged": diverged, "loss": [7.0, final]},
            "grad_norms": {"init": grads, "steps": []}}


def test_the_sweep_tables_group_by_what_changes_the_first_step(tmp_path):
    """lr does not change the first step's gradients (they are taken before the first update): the first-step table
    has one row per init; the sweep table has lr as columns and marks the diverged run."""
    hf, paper = {"layer.0": 1.0, "layer.1": 0.5}, {"layer.0": 0.2, "layer.1": 0.8}
    runs = [fake_run("hf-1e-3", hf, 6.0), fake_run("hf-1e-2", dict(hf), 6.5, True),
            fake_run("paper-1e-3", paper, 5.0), fake_run("paper-1e-2", dict(paper), 4.5)]
    summary = {"study": "g", "config": {"grid": GRID}, "arms": list(study.grid_arms(GRID)), "runs": runs,
               "unigram_loss": 6.25}
    assert study_report.step1_axes(summary) == ["init"]
    text = study_report.table(summary)
    assert "| hf | 6.000 | 6.500 † |" in text and "| paper | 5.000 | 4.500 |" in text
    assert "unigram loss of the training text: 6.250" in text
    assert "| paper | — | 0.200 | 0.800 | 0.800 | 4.00 | — |" in text
    for r, (a, b) in zip(runs, [(0.1, 0.3)] * 2 + [(0.2, 0.2)] * 2):  # the feed-forward output weight's norms
        r["grad_norms"]["init_parameters"] = {"layer.0": {"mlp.down_proj.weight": a},
                                              "layer.1": {"mlp.down_proj.weight": b}}
    text = study_report.table(summary)
    assert "| hf | 0.1000 | 0.3000 | 0.3000 | 3.00 |" in text and "| paper | 0.2000 | 0.2000 | 0.2000 | 1.00 |" in text
    summary["arms"].append("longer")  # an arm outside the grid: in a table of its own
    runs.append({**fake_run("longer", hf, 5.5), "name": "longer", "parameters": 1e6})
    assert "**per arm (outside the grid)**" in study_report.table(summary) and "| longer | 1.00 M | 5.500 |" in \
        study_report.table(summary)
    runs[0]["training"]["loss"] = [7.123456789, 6.0]
    path = study_report.write(summary, tmp_path)  # JSON (floats to 6 significant digits), table and plot
    assert json.loads(path.read_text())["runs"][0]["training"]["loss"] == [7.12346, 6.0]
    assert path.with_suffix(".png").stat().st_size > 0
    runs[1]["grad_norms"]["init"]["layer.0"] = 2.0  # now lr seems to change the first step: it gets a column
    assert study_report.step1_axes(summary) == ["init", "lr"]


def test_unigram_loss_is_the_entropy_of_the_predicted_tokens():
    seqs = torch.tensor([[9, 1, 1, 2], [9, 2, 2, 2]])  # predicted: 1 1 2 2 2 2 (the first of each row is not)
    p = torch.tensor([2 / 6, 4 / 6], dtype=torch.float64)
    assert measure.unigram_loss(seqs) == pytest.approx(float(-(p * p.log()).sum()), rel=1e-12)


def test_first_step_gradients_are_each_parameters_gradient_of_the_models_own_loss():
    """Against transformers' own loss (labels = the input): the same per-parameter gradient norms, by block."""
    model = build("paper", seed=3)
    ids = torch.randint(1, SIZES["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    got = measure.first_step_gradients(model, ids)
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    want: dict = {}
    for name, p in model.named_parameters():
        if name.startswith("model.layers."):
            block, _, inner = name[len("model.layers."):].partition(".")
            want.setdefault(f"layer.{block}", {})[inner] = p.grad.norm().item()
    assert list(got) == ["layer.0", "layer.1"] and set(got["layer.0"]) == set(want["layer.0"])
    for block, params in want.items():
        for inner, norm in params.items():
            assert got[block][inner] == pytest.approx(norm, rel=1e-4), (block, inner)


def test_keys_added_later_leave_the_identity_of_runs_that_keep_their_old_value(tmp_path):
    """A checkpoint written before adam_beta2 and init existed was made with 0.999 and transformers' init: a run with
    those values has the same identity (it resumes); another value is part of the identity (a resume is refused)."""
    seqs = torch.zeros(2, 8, dtype=torch.long)
    old = loop.run_identity(pretrain_cfg(tmp_path), seqs, seqs)
    assert "adam_beta2" not in old["settings"] and "init" not in old["settings"] and "lr" in old["settings"]
    paper = loop.run_identity(pretrain_cfg(tmp_path, "init=paper", "adam_beta2=0.98"), seqs, seqs)
    assert paper["settings"]["init"] == "paper" and paper["settings"]["adam_beta2"] == 0.98
