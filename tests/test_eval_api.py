"""The evaluations from Python (hfpatch.evaluate.run and one function per evaluation): the same numbers as the
command, on a loaded model or a model named as the command names it; settings checked by the command's own rules;
a results folder resumed as the command resumes it."""

import json

import pytest
import torch

import hfpatch.evaluate as evaluate
from hfpatch.evaluate.evaluations import ppl
from hfpatch.tiny import char_text, char_tokenizer, save_sized, sized_model
from hfpatch.utils.modes import evaluating

SETTINGS = {"lengths": [16, 32], "patches": "none,yarn:2", "tokens_per_doc": 600}


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("api") / "doc.txt"
    path.write_text(char_text(3000, seed=3))
    return path


def cells_by_key(data: dict) -> dict:
    return {(c["patch"], c["length"]): c["ppl"] for c in data["cells"]}


def test_a_loaded_model_gives_the_numbers_the_command_gives_for_its_folder(text_file, tmp_path):
    folder = save_sized(tmp_path / "model")
    assert ppl.main(["--model", str(folder), "--text-files", str(text_file), "--lengths", "16,32", "--patches",
                     "none,yarn:2", "--tokens-per-doc", "600", "--no-plot", "--out", str(tmp_path / "cli")]) == 0
    command = json.loads((tmp_path / "cli" / "results.json").read_text())
    data = evaluate.perplexity(sized_model("llama"), char_tokenizer(), text_files=[str(text_file)], **SETTINGS)
    assert cells_by_key(data) == cells_by_key(command)
    assert "**perplexity**" in data["report"]
    named = evaluate.run("ppl", str(folder), text_files=str(text_file), **SETTINGS)  # a name, as the command takes
    assert cells_by_key(named) == cells_by_key(command)


def test_a_results_folder_is_resumed_not_run_again(text_file, tmp_path):
    model, tok = sized_model("llama"), char_tokenizer()
    first = evaluate.perplexity(model, tok, out=str(tmp_path / "r"), text_files=[str(text_file)], **SETTINGS)
    again = evaluate.perplexity(model, tok, out=str(tmp_path / "r"), text_files=[str(text_file)], **SETTINGS)
    assert len(first["runs"]) == 1 and len(again["runs"]) == 1  # nothing left to run: no second run recorded
    assert cells_by_key(again) == cells_by_key(first)


def test_other_weights_are_another_model_for_the_results_file(text_file, tmp_path):
    tok = char_tokenizer()
    evaluate.perplexity(sized_model("llama"), tok, out=str(tmp_path / "r"), text_files=[str(text_file)], **SETTINGS)
    with pytest.raises(ValueError, match="model_files"):
        evaluate.perplexity(sized_model("llama", seed=1), tok, out=str(tmp_path / "r"), text_files=[str(text_file)],
                            **SETTINGS)


@pytest.mark.parametrize("settings,message", [
    ({"lenghts": [16]}, "unknown setting 'lenghts'; it takes: .*lengths"),
    ({"lengths": "abc"}, "is not a number of tokens"),
    ({"no_plot": "yes"}, "no_plot must be True or False"),
    ({"windowing": "sideways"}, "windowing 'sideways': expected chunks, sliding, rolling"),
    ({"patches": "yarn:banana"}, "yarn:banana"),
])
def test_a_bad_setting_is_one_clear_error(text_file, settings, message):
    with pytest.raises(ValueError, match=message):
        evaluate.run("ppl", sized_model("llama"), char_tokenizer(), text_files=[str(text_file)], **settings)


def test_a_loaded_model_needs_its_tokenizer_and_an_evaluation_its_name():
    with pytest.raises(ValueError, match="needs its tokenizer"):
        evaluate.run("ppl", sized_model("llama"))
    listed = ", ".join(evaluate.EVALUATIONS)  # niah, passkey, ppl, ruler
    with pytest.raises(ValueError, match=f"unknown evaluation 'perplexity'; the evaluations: {listed}$"):
        evaluate.run("perplexity", "smollm2")


def modes_of(model) -> dict:
    return {name: module.training for name, module in model.named_modules()}


def test_a_model_left_in_train_mode_is_measured_in_eval_mode_and_given_back_its_modes(text_file):
    """Dropout on would change every number, and differently on each run: the evaluation runs in eval mode and gives
    each module back its own mode (here the model in train mode but for its first block)."""
    model, tok = sized_model("llama", attention_dropout=0.3), char_tokenizer()
    settings = {"text_files": [str(text_file)], "lengths": [32], "patches": "none", "tokens_per_doc": 600}
    in_eval = cells_by_key(evaluate.perplexity(model.eval(), tok, **settings))
    model.train()
    model.model.layers[0].eval()
    modes = modes_of(model)
    first = cells_by_key(evaluate.perplexity(model, tok, **settings))
    second = cells_by_key(evaluate.run("ppl", model, tok, **settings))
    assert first == second == in_eval
    assert modes_of(model) == modes and model.training and not model.model.layers[0].training


def test_evaluating_gives_each_module_its_mode_back_after_an_exception():
    model = sized_model("llama").train()
    model.lm_head.eval()
    modes = modes_of(model)
    with pytest.raises(RuntimeError, match="inside"), evaluating(model):
        assert not any(modes_of(model).values())
        raise RuntimeError("inside")
    assert modes_of(model) == modes


def test_a_loaded_model_runs_in_its_own_dtype_and_the_results_say_which(text_file, tmp_path):
    """dtype says how a model given by name is loaded: with a loaded model, one that differs from the model's is
    refused (not ignored and recorded), a matching one is accepted, and results.json records the dtype that ran."""
    tok, settings = char_tokenizer(), {"text_files": [str(text_file)], "lengths": [32], "patches": "none"}
    with pytest.raises(ValueError, match=r"dtype='bf16' is how a model given by name is loaded; this loaded model is "
                                         r"torch.float32 .*leave dtype out, or cast the model first"):
        evaluate.perplexity(sized_model("llama"), tok, dtype="bf16", **settings)
    assert evaluate.perplexity(sized_model("llama"), tok, dtype="fp32", **settings)["settings"]["dtype"] == "fp32"
    bf16 = sized_model("llama").to(torch.bfloat16)
    evaluate.perplexity(bf16, tok, out=str(tmp_path / "r"), **settings)
    written = json.loads((tmp_path / "r" / "results.json").read_text())
    assert written["settings"]["dtype"] == "bf16" and written["model"]["dtype"] == "bfloat16"
    with pytest.raises(ValueError, match=r"dtype='fp16' .* torch\.bfloat16"):
        evaluate.perplexity(bf16, tok, dtype="fp16", **settings)


@pytest.mark.parametrize("settings,message", [
    ({"device": "cuda:7"}, r"device='cuda:7' is where a model given by name is loaded; this loaded model is on cpu"),
    ({"device_map": "auto"}, r"device_map='auto' is how a model given by name is placed .* leave device_map out"),
])
def test_a_loaded_model_refuses_the_placement_options_it_would_ignore(text_file, settings, message):
    with pytest.raises(ValueError, match=message):
        evaluate.perplexity(sized_model("llama"), char_tokenizer(), text_files=[str(text_file)], lengths=[32],
                            patches="none", **settings)


def test_patches_none_is_the_default_and_a_list_of_specs_is_the_comma_separated_string(text_file):
    tok, settings = char_tokenizer(), {"text_files": [str(text_file)], "lengths": [32]}
    left_out = evaluate.perplexity(sized_model("llama"), tok, **settings)
    assert left_out["settings"]["patches"] == ["none", "yarn:2"]  # the evaluation's default
    assert cells_by_key(evaluate.perplexity(sized_model("llama"), tok, patches=None, **settings)) \
        == cells_by_key(left_out)
    assert cells_by_key(evaluate.run("ppl", sized_model("llama"), tok, patches=("none", "yarn:2"), **settings)) \
        == cells_by_key(left_out)


@pytest.mark.parametrize("patches,given", [
    ({"position": "yarn", "factor": 2}, r"got \{'position': 'yarn', 'factor': 2\} \(dict\)$"),
    (2, r"got 2 \(int\)$"),
    ([None], "got a list holding None$"),
    (["none", {"position": "yarn"}], r"got a list holding \{'position': 'yarn'\} \(dict\)$"),
])
def test_patches_of_another_type_are_one_type_error_saying_what_is_taken(text_file, patches, given):
    taken = (r"^patches takes patch spec strings, as `hfpatch eval --patches` does: one comma-separated string "
             r"\('none,yarn:2'\) or a list of spec strings .*")
    with pytest.raises(TypeError, match=taken + given):
        evaluate.run("ppl", sized_model("llama"), char_tokenizer(), text_files=[str(text_file)], lengths=[32],
                     patches=patches)
