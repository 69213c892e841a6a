"""A patched model trains under transformers.Trainer and TRL's SFTTrainer and keeps its patch: the checkpoints they
write (checkpoint-N/, save_model) reload patched with hfpatch.from_pretrained, a native patch (yarn) reloads patched
in plain transformers too, a non-native one makes a plain reload warn (naming hfpatch.from_pretrained) instead of
silently building the unpatched model, and a run resumed from a checkpoint goes on with the patch. SmolLM2 with
LoRA through peft: a few steps, merged, saved by the model's own save_pretrained, reloaded patched."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from conftest import plain_reload_log
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

import hfpatch
from hfpatch import tiny

NON_NATIVE = [dict(position="alibi"), dict(norm="layernorm"), dict(position="self-extend", group_size=4, window=8)]


def _name(kwargs: dict) -> str:
    return "+".join(f"{k}={v}" for k, v in kwargs.items())


def _patched(**kwargs):
    model = tiny.build_tiny("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # plain-swap warnings
        hfpatch.patch(model, **kwargs)
    return model


def _examples(n=8, length=24, seed=0) -> list[dict]:
    ids = tiny.sample_ids(n, length, seed=seed)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def _args(out, steps=2, **kw) -> TrainingArguments:
    given = dict(output_dir=str(out), max_steps=steps, save_steps=1, per_device_train_batch_size=2,
                 learning_rate=1e-2, report_to=[], use_cpu=True, logging_strategy="no", seed=0, data_seed=0,
                 dataloader_num_workers=0, disable_tqdm=True)
    return TrainingArguments(**{**given, **kw})


@torch.no_grad()
def _logits(model, ids):
    return model.eval()(input_ids=ids, use_cache=False).logits


def _train(model, out, steps=2, **kw) -> Trainer:
    trainer = Trainer(model=model, args=_args(out, steps, **kw), train_dataset=_examples())
    trainer.train()
    return trainer


@pytest.mark.parametrize("kwargs", NON_NATIVE, ids=_name)
def test_trainer_checkpoints_of_a_non_native_patch_reload_patched_and_make_a_plain_reload_warn(tmp_path, kwargs):
    model = _patched(**kwargs)
    trainer = _train(model, tmp_path / "run")
    trainer.save_model(str(tmp_path / "final"))
    ids = tiny.sample_ids(1, 24, seed=5)
    for folder in (tmp_path / "run" / "checkpoint-2", tmp_path / "final"):
        config = json.loads((folder / "config.json").read_text())
        assert "hfpatch" in config["quantization_config"]["quant_method"]
        log = plain_reload_log(folder)
        assert "hfpatch.from_pretrained" in log and "unpatched architecture" in log
        loaded = hfpatch.from_pretrained(folder)
        assert hfpatch.describe(loaded)["applied"] == hfpatch.describe(model)["applied"]
        assert torch.equal(_logits(loaded, ids), _logits(model, ids))
    # the trained model keeps its own config: the mark was there for the saves only
    assert getattr(model.config, "quantization_config", None) is None


def test_trainer_checkpoint_of_a_native_patch_reloads_patched_in_plain_transformers(tmp_path):
    model = _patched(position="yarn", factor=2.0)
    _train(model, tmp_path)
    folder = tmp_path / "checkpoint-2"
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    plain = AutoModelForCausalLM.from_pretrained(folder)
    assert plain.config.rope_parameters["rope_type"] == "yarn"
    ids = tiny.sample_ids(1, 2 * tiny.WINDOW, seed=5)  # past the trained window, where yarn differs from plain RoPE
    assert torch.allclose(_logits(plain, ids), _logits(model, ids), atol=1e-5)
    assert hfpatch.describe(hfpatch.from_pretrained(folder))["applied"] == hfpatch.describe(model)["applied"]


def test_an_unpatched_model_saves_as_transformers_does(tmp_path):
    model = _patched(position="alibi")
    hfpatch.unpatch(model)
    assert "save_pretrained" not in vars(model)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert "quantization_config" not in config and "hfpatch" not in config


@pytest.mark.parametrize("kwargs", [dict(norm="layernorm"), dict(position="alibi")], ids=_name)
def test_a_run_resumed_from_its_checkpoint_keeps_the_patch_and_ends_where_an_uninterrupted_one_does(tmp_path,
                                                                                                      kwargs):
    straight = _patched(**kwargs)
    _train(straight, tmp_path / "straight", steps=4)
    _train(_patched(**kwargs), tmp_path / "cut", steps=4)  # checkpoint-1..4, optimizer and RNG states included
    resumed = _patched(**kwargs)
    trainer = Trainer(model=resumed, args=_args(tmp_path / "cut", 4), train_dataset=_examples())
    trainer.train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-2"))
    assert hfpatch.describe(resumed)["applied"] == hfpatch.describe(straight)["applied"]
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), name
    loaded = hfpatch.from_pretrained(tmp_path / "cut" / "checkpoint-4")
    ids = tiny.sample_ids(1, 24, seed=5)
    assert torch.allclose(_logits(loaded, ids), _logits(straight, ids), atol=1e-5)


def test_trl_sft_trainer_keeps_the_patch(tmp_path, tiny_tokenizer_dir):
    trl = pytest.importorskip("trl", reason="the trl extra (pip install -c constraints.txt '.[trl]')")
    model = _patched(position="alibi")
    data = [{"input_ids": row.tolist()} for row in tiny.sample_ids(8, 24)]
    config = trl.SFTConfig(output_dir=str(tmp_path), max_steps=2, save_steps=1, per_device_train_batch_size=2,
                           report_to=[], use_cpu=True, logging_strategy="no", disable_tqdm=True,
                           max_length=24, bf16=False)
    datasets = pytest.importorskip("datasets")
    trainer = trl.SFTTrainer(model=model, args=config, train_dataset=datasets.Dataset.from_list(data),
                             processing_class=AutoTokenizer.from_pretrained(tiny_tokenizer_dir))
    trainer.train()
    folder = tmp_path / "checkpoint-2"
    assert "hfpatch.from_pretrained" in plain_reload_log(folder)
    loaded = hfpatch.from_pretrained(folder)
    assert hfpatch.describe(loaded)["applied"] == hfpatch.describe(model)["applied"]
    ids = tiny.sample_ids(1, 24, seed=5)
    assert torch.equal(_logits(loaded, ids), _logits(model, ids))


@pytest.mark.slow
def test_smollm2_with_lora_trains_under_trainer_and_its_merged_save_reloads_patched(tmp_path):
    peft = pytest.importorskip("peft")
    from hfpatch import models

    gguf, tokenizer = models.load("smollm2", dtype=torch.float32)
    # Trainer refuses a model that keeps transformers' GGUF quantizer: train the float checkpoint saved from it
    hfpatch.save_pretrained(gguf, tmp_path / "base")
    del gguf
    model = hfpatch.patch(hfpatch.from_pretrained(tmp_path / "base", dtype=torch.float32), position="yarn", factor=2.0)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    text = "The quick brown fox jumps over the lazy dog. " * 8
    ids = tokenizer(text, return_tensors="pt").input_ids[0, :64]
    data = [{"input_ids": ids, "labels": ids.clone()} for _ in range(4)]
    trainer = Trainer(model=lora, args=_args(tmp_path / "run", learning_rate=1e-3), train_dataset=data)
    trainer.train()
    assert (tmp_path / "run" / "checkpoint-2" / "adapter_model.safetensors").exists()
    merged = lora.merge_and_unload()
    assert hfpatch.describe(merged)["applied"]["position"]["scheme"] == "yarn"
    merged.save_pretrained(tmp_path / "merged")  # the model's own save, as a script after Trainer would
    loaded = hfpatch.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert hfpatch.describe(loaded)["applied"] == hfpatch.describe(merged)["applied"]
    probe = ids[None, :32]
    assert torch.allclose(_logits(loaded, probe), _logits(merged, probe), atol=1e-4)
