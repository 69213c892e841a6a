"""Adapters are read off the model. For each family hfpatch 0.1 described by hand, whether inference alone
reproduces that description (where it does, the hand-written file is gone); where it does not, the override table
supplies exactly the fields it cannot see. Plus: paths resolve, every norm is covered, unreadable models are refused
with the model untouched."""

import dataclasses

import pytest
import torch
from conftest import FAMILIES, assert_same_fingerprint, fingerprint, tiny_model
from transformers import LlamaConfig, PreTrainedModel

import hfpatch
from hfpatch.adapters import OVERRIDES, InferenceError, adapter_for, classify_norm, infer
from hfpatch.apply import get_path

# hfpatch 0.1's hand-written adapters (hfpatch/adapters/<family>.py before inference), as data.
_LLAMA = dict(
    layers="layers", attention="self_attn", norms=("input_layernorm", "post_attention_layernorm"), mlp="mlp",
    final_norm="norm", embedding_norm=None, head_norms=(), qk_norms=(), norm="rmsnorm", norm_offset=0.0,
    placement="pre",
    residual_readers={"input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                      "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj")},
    residual_writers=("self_attn.o_proj", "mlp.down_proj"), embedding_writers=("embed_tokens",), final_readers=(),
    rotaries=("rotary_emb",), position_table=None, position_offset=0, causal=True)
_SANDWICH = dict(_LLAMA, norms=("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                                "post_feedforward_layernorm"), placement="sandwich", residual_readers={},
                 residual_writers=(), embedding_writers=(), norm_offset=1.0)
_QK = ("self_attn.q_norm", "self_attn.k_norm")
HAND_WRITTEN = {
    "llama": _LLAMA, "mistral": _LLAMA, "qwen2": _LLAMA, "qwen3": dict(_LLAMA, qk_norms=_QK),
    "gemma": dict(_LLAMA, norm_offset=1.0),
    "gemma2": _SANDWICH,
    # 0.1 also listed rope_layer_types=("full_attention",); that default is now derived from the config's nesting
    "gemma3_text": dict(_SANDWICH, qk_norms=_QK),
    # 0.1 also listed native_rope_types={default, longrope}; now found by building Phi3Config with the rope type
    "phi3": dict(_LLAMA, residual_readers={"input_layernorm": ("self_attn.qkv_proj",),
                                           "post_attention_layernorm": ("mlp.gate_up_proj",)}),
    "olmo2": dict(_LLAMA, norms=("post_attention_layernorm", "post_feedforward_layernorm"), qk_norms=_QK,
                  placement="post_sublayer", residual_readers={}, residual_writers=(), embedding_writers=()),
    # 0.1 called the parallel residual "pre"; inference says "pre" and parallel=True
    "gpt_neox": dict(_LLAMA, attention="attention", final_norm="final_layer_norm", norm="layernorm",
                     residual_readers={"input_layernorm": ("attention.query_key_value",),
                                       "post_attention_layernorm": ("mlp.dense_h_to_4h",)},
                     residual_writers=("attention.dense", "mlp.dense_4h_to_h"), embedding_writers=("embed_in",)),
    "gpt2": dict(layers="h", attention="attn", norms=("ln_1", "ln_2"), mlp="mlp", final_norm="ln_f",
                 embedding_norm=None, head_norms=(), qk_norms=(), norm="layernorm", norm_offset=0.0,
                 placement="pre", residual_readers={"ln_1": ("attn.c_attn",), "ln_2": ("mlp.c_fc",)},
                 residual_writers=("attn.c_proj", "mlp.c_proj"), embedding_writers=("wte", "wpe"), final_readers=(),
                 rotaries=(), position_table="wpe", position_offset=0, causal=True),
    "opt": dict(layers="decoder.layers", attention="self_attn", norms=("self_attn_layer_norm", "final_layer_norm"),
                mlp=None, final_norm="decoder.final_layer_norm", embedding_norm=None, head_norms=(), qk_norms=(),
                norm="layernorm", norm_offset=0.0, placement="pre",
                residual_readers={"self_attn_layer_norm": ("self_attn.q_proj", "self_attn.k_proj",
                                                           "self_attn.v_proj"), "final_layer_norm": ("fc1",)},
                residual_writers=("self_attn.out_proj", "fc2"),
                embedding_writers=("decoder.project_in|decoder.embed_tokens", "decoder.embed_positions"),
                final_readers=("decoder.project_out",), rotaries=(), position_table="decoder.embed_positions",
                position_offset=2, causal=True),
    "bert": dict(layers="encoder.layer", attention="attention.self",
                 norms=("attention.output.LayerNorm", "output.LayerNorm"), mlp=None, final_norm=None,
                 embedding_norm="embeddings.LayerNorm", head_norms=("cls.predictions.transform.LayerNorm",),
                 qk_norms=(), norm="layernorm", norm_offset=0.0, placement="post", residual_readers={},
                 residual_writers=(), embedding_writers=(), final_readers=(), rotaries=(),
                 position_table="embeddings.position_embeddings", position_offset=0, causal=False),
}
# Families where inference alone gives the hand-written description; the others need these override fields.
REPRODUCED = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "gpt_neox",
              "gpt2"}


def _differences(adapter, expected, config) -> set:
    out = set()
    for name, want in expected.items():
        have = adapter.placement_of(config) if name == "placement" else getattr(adapter, name)
        if have != want:
            out.add(name)
    return out


def test_every_hand_written_family_is_stated():
    assert sorted(HAND_WRITTEN) == sorted(FAMILIES)
    assert set(OVERRIDES) == set(FAMILIES) - REPRODUCED


@pytest.mark.parametrize("family", FAMILIES)
def test_inference_against_the_hand_written_adapter(family):
    """Inference alone reproduces 0.1's hand-written adapter exactly for the REPRODUCED families; for the others it
    differs in (at most) the fields OVERRIDES supplies, and adapter_for (inference + overrides) reproduces it."""
    model = tiny_model(family)
    expected = HAND_WRITTEN[family]
    inferred = infer(model)
    diff = _differences(inferred, expected, model.config)
    if family in REPRODUCED:
        assert diff == set(), f"inference differs from the hand-written {family} adapter in {sorted(diff)}"
    else:
        assert diff, f"{family} is reproduced by inference alone now: drop its override"
        assert diff <= set(OVERRIDES[family]) | {"mlp"}, sorted(diff - set(OVERRIDES[family]))
    assert _differences(adapter_for(model), expected, model.config) == set()
    assert inferred.parallel == (family == "gpt_neox")


@pytest.mark.parametrize("family", FAMILIES)
def test_paths_resolve_and_cover_every_norm(family):
    model = tiny_model(family)
    adapter = adapter_for(model)
    base = model.base_model
    layers = get_path(base, adapter.layers)
    assert len(layers) == model.config.num_hidden_layers
    for layer in layers:
        assert "attention" in type(get_path(layer, adapter.attention)).__name__.lower()
    for r in adapter.rotaries:
        assert "rotary" in type(get_path(base, r)).__name__.lower()
    prefix = model.base_model_prefix + "."
    declared = set()
    for i in range(model.config.num_hidden_layers):
        declared |= {f"{prefix}{adapter.layers}.{i}.{n}" for n in adapter.norms + adapter.qk_norms}
    declared |= {prefix + p for p in (adapter.final_norm, adapter.embedding_norm) if p}
    declared |= set(adapter.head_norms)
    present = {n for n, m in model.named_modules() if "norm" in type(m).__name__.lower()}
    assert present == declared


def test_adapter_is_cached_on_the_model_and_copied_with_it():
    import copy

    model = tiny_model("llama")
    a = adapter_for(model)
    assert adapter_for(model) is a
    assert adapter_for(copy.deepcopy(model)) == a


def _rms(x, w, eps, offset):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (offset + w)


class _ScaledRMS(torch.nn.Module):
    """A norm with an unfamiliar class name: recognised by what it computes."""

    def __init__(self, dim, offset):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))
        self.offset, self.epsilon = offset, 1e-6

    def forward(self, x):
        return _rms(x.float(), self.weight.float(), self.epsilon, self.offset).to(x.dtype)


class _Other(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))

    def forward(self, x):
        return x * self.weight  # no normalisation at all


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_norms_are_recognised_numerically(offset):
    cls = classify_norm(_ScaledRMS(16, offset))
    assert (cls.kind, cls.offset, cls.eps, cls.eps_attr) == ("rmsnorm", offset, 1e-6, "epsilon")
    ln = classify_norm(torch.nn.LayerNorm(16, eps=1e-5))
    assert (ln.kind, ln.offset, ln.eps) == ("layernorm", 0.0, 1e-5)
    assert classify_norm(_Other(16)) is None
    assert classify_norm(torch.nn.Linear(16, 16)) is None


@pytest.mark.parametrize("family,upcast", [("llama", "normalize"), ("gemma", "fp32"), ("gpt2", "fp32")])
def test_how_a_family_norm_rounds_in_bf16_is_read_numerically(family, upcast):
    """LlamaRMSNorm normalizes in float32 and multiplies by its weight in the input dtype; GemmaRMSNorm and
    nn.LayerNorm round once, at the end (transformers' modeling files)."""
    classes = adapter_for(tiny_model(family)).norm_classes
    assert {c.upcast for c in classes.values()} == {upcast}


class _NoBlocks(PreTrainedModel):
    config_class = LlamaConfig

    def __init__(self, config):
        super().__init__(config)
        self.embed = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.mix = torch.nn.Linear(config.hidden_size, config.hidden_size)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids=None, **kwargs):
        return (self.mix(self.embed(input_ids)),)


def test_a_model_whose_structure_cannot_be_read_is_refused_untouched():
    model = _NoBlocks(LlamaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2))
    fp = fingerprint(model)
    for kwargs in (dict(position="yarn", factor=2.0), dict(norm="rmsnorm"), dict(position="alibi")):
        with pytest.raises(InferenceError, match="cannot find the list of transformer blocks"):
            hfpatch.patch(model, **kwargs)
    assert_same_fingerprint(fingerprint(model), fp)
    with pytest.raises(TypeError, match="PreTrainedModel"):
        hfpatch.patch(torch.nn.Linear(2, 2), position="yarn", factor=2)


def test_a_hidden_rotation_is_not_taken_for_no_positions():
    """GPT-J rotates q/k inside its attention from a sin/cos table (no inv_freq module): hfpatch must neither offer
    RoPE schemes nor claim that NoPE/ALiBi/sinusoidal remove its positions."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("gptj", vocab_size=50, n_embd=32, n_layer=1, n_head=4, rotary_dim=4, n_positions=64,
                               bos_token_id=1, eos_token_id=2)
    model = AutoModelForCausalLM.from_config(cfg)
    adapter = adapter_for(model)
    assert adapter.position_signal == "unknown"
    fp = fingerprint(model)
    for scheme in ("nope", "sinusoidal", "alibi", "yarn"):
        with pytest.raises(ValueError, match="gptj"):
            hfpatch.patch(model, position=scheme, **({"factor": 2.0} if scheme == "yarn" else {}))
    assert_same_fingerprint(fingerprint(model), fp)
    assert set(hfpatch.describe(model)["patches"]["position"]) == set()
    assert dataclasses.asdict(adapter)["notes"]["positions"].startswith("the model encodes position")
