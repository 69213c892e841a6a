"""A norm and an evaluation registered from outside the package, each with one call, run end to end
(docs/extending.md). The norm kind `meanabs` (defined here) is registered through the norm registry and patched in
with `hfpatch.patch(model, norm="meanabs")`: its logits equal a float64 hand computation of the formula, describe(),
the command line, save and reload pick it up, and unpatch gives the model back exactly. The evaluation `echo`
(tests/echo.py) is registered through hfpatch.evaluate.evaluations.register and run by `hfpatch.evaluate.run` and
by `hfpatch eval echo`, its numbers checked against the model's own forward. A registry takes each name once, for
good: each registration here is undone after its test. A position scheme and an engine registered from outside are
tests/test_scheme_records.py's and tests/test_eval_engines.py's."""

from __future__ import annotations

import contextlib
import copy
import io
import json

import pytest
import torch
from conftest import logits, max_diff, tokens

import hfpatch
import hfpatch.evaluate
from hfpatch.cli import build_parser
from hfpatch.cli import main as cli_main
from hfpatch.evaluate import evaluations
from hfpatch.norm.kinds import NORMS, Norm
from hfpatch.norm.modules import NormModule
from hfpatch.tiny import char_tokenizer, save_sized, sized_model

# ------------------------------------------------------------------------------------------------------- a norm


# --8<-- [start:norm]
class MeanAbsNorm(NormModule):
    """x / (mean |x| + eps), times the weight (plus the bias, where the replaced norm had one)."""

    kind = "meanabs"

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return h / (h.abs().mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._affine(self.normalize(x)).to(x.dtype)


MEANABS = Norm(MeanAbsNorm, "x / mean|x|, times the weight",
               inexact="meanabs divides by the mean absolute value, RMSNorm and LayerNorm by a root mean square",
               bias=False)
# --8<-- [end:norm]


@pytest.fixture
def meanabs(monkeypatch):
    """norm="meanabs", registered as a user registers it (NORMS.register), for this test only."""
    monkeypatch.setattr(NORMS, "_records", dict(NORMS._records))
    NORMS.register("meanabs", MEANABS)


def hand_computed(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` whose RMSNorm modules compute x / (mean |x| + eps) * weight in float64 instead."""
    hand = copy.deepcopy(model)
    for module in hand.modules():
        if type(module).__name__.endswith("RMSNorm"):
            def forward(x, m=module):
                h = x.double()
                return (h / (h.abs().mean(-1, keepdim=True) + m.variance_epsilon) * m.weight.double()).to(x.dtype)

            module.forward = forward
    return hand


def test_a_norm_registered_from_outside_is_patched_in_and_out(meanabs, tmp_path):
    model = sized_model("llama").eval()
    assert "meanabs" in hfpatch.describe(model)["patches"]["norm"]  # what applies to the model
    ids = tokens(48)
    before, hand = logits(model, ids), logits(hand_computed(model), ids)
    assert max_diff(hand, before) > 1e-2  # the formula changes what the model computes

    with pytest.warns(UserWarning, match="plain swap, not function-preserving: meanabs divides by the mean"):
        hfpatch.patch(model, norm="meanabs")
    swapped = [m for m in model.modules() if isinstance(m, MeanAbsNorm)]
    assert len(swapped) == 2 * model.config.num_hidden_layers + 1  # two per block, and the final norm
    assert max_diff(logits(model, ids), hand) < 1e-5
    assert hfpatch.describe(model)["norm"]["kind"] == "meanabs"
    assert build_parser("patch").parse_args(["patch", "m", "--out", "o", "--norm", "meanabs"]).norm == "meanabs"

    with pytest.warns(UserWarning, match="norm='meanabs' has no form that LlamaConfig can express"):
        hfpatch.save_pretrained(model, tmp_path / "saved")
    reloaded = hfpatch.from_pretrained(tmp_path / "saved").eval()
    assert max_diff(logits(reloaded, ids), logits(model, ids)) == 0

    hfpatch.unpatch(model)
    assert not any(isinstance(m, MeanAbsNorm) for m in model.modules())
    assert max_diff(logits(model, ids), before) == 0


# ------------------------------------------------------------------------------------------------- an evaluation


@pytest.fixture
def echo(monkeypatch):
    """`hfpatch eval echo`, registered as a user registers it (its module, by name), for this test only."""
    monkeypatch.setattr(evaluations.EVALUATIONS, "_records", dict(evaluations.EVALUATIONS._records))
    evaluations.register("echo", "echo")
    import echo as module  # tests/echo.py

    return module


def second_copy_nll(model: torch.nn.Module, ids: list[int]) -> float:
    """The summed NLL of the second half of `ids` given all before it, from the model's own logits in float64."""
    x = torch.tensor([ids])
    half = len(ids) // 2
    with torch.no_grad():
        scores = model(x).logits[0, half - 1:-1].double()
    return torch.nn.functional.cross_entropy(scores, x[0, half:], reduction="sum").item()


def check_cells(data: dict, module, tok, models: dict[str, torch.nn.Module], lengths: list[int], trials: int):
    """Every cell complete, and each trial's NLL the one the model's forward gives its tokens."""
    vocab = module.ordinary_ids(tok)
    assert {(c["patch"], c["length"]) for c in data["cells"]} == {(p, n) for p in models for n in lengths}
    for cell in data["cells"]:
        assert cell["complete"] and [t["trial"] for t in cell["trials"]] == list(range(trials))
        for t in cell["trials"]:
            ids = module.echo_ids(vocab, cell["length"], 0, t["trial"])
            assert t["tokens"] == cell["length"] // 2
            assert t["nll_sum"] == pytest.approx(second_copy_nll(models[cell["patch"]], ids), rel=1e-5)
        assert cell["mean_nll"] == pytest.approx(sum(t["nll_sum"] for t in cell["trials"]) / (trials * cell["length"]
                                                                                             // 2))


def test_an_evaluation_registered_from_outside_runs_from_python(echo):
    model, tok = sized_model("llama").eval(), char_tokenizer()
    yarn = hfpatch.patch(copy.deepcopy(model), position="yarn", factor=2.0)
    data = hfpatch.evaluate.run("echo", model, tok, lengths=[32, 128], trials=2, patches="none,yarn:2")
    assert data["kind"] == "echo"
    check_cells(data, echo, tok, {"none": model, "yarn:2": yarn}, [32, 128], 2)
    assert "**mean NLL of the second copy** (nats per token)" in data["report"]
    assert hfpatch.describe(model)["applied"] == {}  # the run left the model unpatched


def test_an_evaluation_registered_from_outside_is_an_hfpatch_eval_command(echo, tmp_path, capsys):
    folder = save_sized(tmp_path / "model")
    helped = io.StringIO()
    with contextlib.redirect_stdout(helped), contextlib.suppress(SystemExit):
        cli_main(["eval", "echo", "--help"])
    assert "usage: hfpatch eval echo" in helped.getvalue()
    assert "Echo: random tokens read twice in one window" in helped.getvalue()

    out = tmp_path / "echo"
    assert cli_main(["eval", "echo", "--model", str(folder), "--lengths", "32,64", "--trials", "1", "--patches",
                     "none", "--out", str(out)]) == 0
    data = json.loads((out / "results.json").read_text())
    check_cells(data, echo, char_tokenizer(), {"none": hfpatch.from_pretrained(folder).eval()}, [32, 64], 1)
    table = (out / "table.md").read_text()
    assert "| patch | 32 | 64 |" in table and table.strip() in capsys.readouterr().out
    assert (out / "echo.png").stat().st_size > 0


def test_an_evaluation_is_registered_under_its_own_name_only(echo):
    with pytest.raises(ValueError, match="'echo' is registered twice"):
        evaluations.register("echo", "echo")
    with pytest.raises(ValueError, match="its module 'echo' gives it the name 'echo'"):
        evaluations.register("echo2", "echo")
    with pytest.raises(ValueError, match="Echo is named 'echo', as its module is"):
        evaluations.register("echo2", echo.EVALUATION)
    with pytest.raises(TypeError, match="an evaluation is an instance of a subclass of"):
        evaluations.register("echo2", echo.Echo)
    assert list(evaluations.EVALUATIONS) == ["niah", "passkey", "ppl", "ruler", "echo"]
