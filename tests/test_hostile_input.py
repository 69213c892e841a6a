"""Model folders are data, not programs: the Python code a folder carries is not run, and pickled weights are not
loaded, unless the user asks (API keyword, CLI flag, recipe key); each refusal is one error that says how to opt in.
(YAML configs: tests/test_recipes.py; checkpoint pickles: tests/test_recipe_faults.py.)"""

import json
import sys

import pytest
import torch
from conftest import REPO, logits, tiny_model, tokens

import hfpatch
from hfpatch.cli import main
from hfpatch.models import load

CODE = """
from pathlib import Path
Path({ran!r}).touch()  # what any code in a model folder could do
from transformers import LlamaConfig, LlamaForCausalLM
class EvilConfig(LlamaConfig):
    model_type = "hfpatch_evil"
class EvilForCausalLM(LlamaForCausalLM):
    config_class = EvilConfig
"""


@pytest.fixture
def remote_code(tmp_path):
    """A saved tiny Llama whose config asks for its own classes (auto_map), defined in a module that leaves a file
    behind when it is imported."""
    path, ran = tmp_path / "remote", tmp_path / "code-ran"
    hfpatch.save_pretrained(tiny_model("llama"), path)
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="hfpatch_evil", architectures=["EvilForCausalLM"],
                  auto_map={"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilForCausalLM"})
    (path / "config.json").write_text(json.dumps(config))
    (path / "evil.py").write_text(CODE.format(ran=str(ran)))
    return path, ran


@pytest.fixture
def pickled(tmp_path):
    """A saved tiny Llama whose weights are a pickle (pytorch_model.bin), as older checkpoints are."""
    model, path = tiny_model("llama"), tmp_path / "pickled"
    hfpatch.save_pretrained(model, path)
    (path / "model.safetensors").unlink()
    torch.save(model.state_dict(), path / "pytorch_model.bin")
    return model, path


def cli(capsys, *args):
    code = main(list(args))
    return code, capsys.readouterr().err


@pytest.fixture
def modules_cache(tmp_path, monkeypatch):
    """Where transformers copies a folder's code before importing it: a temporary folder (not ~/.cache), and the
    imported module forgotten afterwards."""
    import transformers.dynamic_module_utils as dynamic

    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield
    for name in [n for n in sys.modules if n.startswith("transformers_modules")]:
        del sys.modules[name]


def refused_by_load_and_from_pretrained(path, load_match, from_pretrained_match):
    """hfpatch's loader and hfpatch.from_pretrained both refuse the folder `path` with a ValueError, matching
    `load_match` and `from_pretrained_match`."""
    with pytest.raises(ValueError, match=load_match):
        load(str(path))
    with pytest.raises(ValueError, match=from_pretrained_match):
        hfpatch.from_pretrained(path)


def test_the_code_of_a_model_folder_is_not_run_unless_asked(remote_code, modules_cache, capsys):
    path, ran = remote_code
    refused_by_load_and_from_pretrained(path, r"trust_remote_code=True.*--trust-remote-code.*trust_remote_code: true",
                                        r"from_pretrained\(..., trust_remote_code=True\)")
    code, err = cli(capsys, "describe", str(path))
    assert code == 2 and err.count("\n") == 1 and "--trust-remote-code" in err
    assert not ran.exists()
    model, _ = load(str(path), trust_remote_code=True)  # asked for, the folder's code runs
    assert ran.exists() and type(model).__name__ == "EvilForCausalLM"


def test_pickled_weights_are_not_loaded_unless_asked(pickled, tmp_path, capsys):
    model, path = pickled
    refused_by_load_and_from_pretrained(path, r"pickles \(pytorch_model.bin\).*allow_pickled_weights=True",
                                        r"use_safetensors=None")
    code, err = cli(capsys, "patch", str(path), "--position", "yarn", "--factor", "2", "--out", str(tmp_path / "o"))
    assert code == 2 and "--allow-pickled-weights" in err and not (tmp_path / "o").exists()
    loaded, _ = load(str(path), allow_pickled_weights=True)
    x = tokens(40)
    assert torch.equal(logits(loaded, x), logits(model, x))
    assert torch.equal(logits(hfpatch.from_pretrained(path, use_safetensors=None), x), logits(model, x))


def test_recipes_refuse_them_too_and_have_keys_to_opt_in(pickled, remote_code, tmp_path, capsys):
    import importlib.util

    from hfpatch.train.cli import run

    spec = importlib.util.spec_from_file_location("heal", REPO / "recipes" / "heal.py")
    heal = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(heal)
    text = tmp_path / "text.txt"
    text.write_text("some text " * 100)
    for folder, key in [(pickled[1], "allow_pickled_weights: true"), (remote_code[0], "trust_remote_code: true")]:
        argv = [f"model={folder}", f"data.text_files=[{text}]", f"output_dir={tmp_path / 'o'}"]
        assert run("heal", heal.main, argv) == 2
        assert key in capsys.readouterr().err
    assert not remote_code[1].exists()
