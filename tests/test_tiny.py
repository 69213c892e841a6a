"""hfpatch.tiny: every causal-LM model_type of the installed transformers builds tiny, runs a forward pass and a cached
greedy generate on input_ids, or is listed in EXPECTED_FAILURES with its reason (and still fails)."""

import copy

import pytest
import torch
from transformers import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from hfpatch import tiny

TYPES = tiny.causal_lm_types()
PER_LAYER_KINDS = ("layer_types", "mlp_layer_types", "layers_block_type", "block_types")
MAX_PARAMS = 3_000_000  # a tiny model: the family sweeps build every family several times in CI
PROMPT = 24  # longer than the tiny sliding windows (SLIDING), so their caches roll over while generating


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models on a shared CPU: one intra-op thread is ~100x faster than two threads fighting other jobs."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def default_config(model_type):
    """The family's default config, completed where tiny.py completes it before shrinking."""
    with tiny.quiet():
        return CONFIG_MAPPING[model_type](**copy.deepcopy(tiny._DEFAULTS.get(model_type, {})))


def test_causal_lm_types_are_the_mapping_sorted():
    assert sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) == TYPES
    assert len(TYPES) == len(set(TYPES))


def test_expected_failures_are_causal_lm_types_with_reasons():
    for model_type, reason in tiny.EXPECTED_FAILURES.items():
        assert model_type in TYPES
        assert reason and "\n" not in reason


def generate_and_check(model):
    """Cached greedy generation runs. For RoPE families (what hfpatch's position schemes patch), every step's logits
    equal an uncached forward over the same tokens: the native baseline that patched models are compared with.
    Several older families without RoPE prepare generation inputs differently from a plain forward by design
    (xlnet and xlm append a token to predict, the roberta family numbers positions from 0 in generate but from the
    padding index in forward, reformer hashes at random), so there only the generation itself is checked."""
    seq, diffs = tiny.greedy_check(model, prompt=PROMPT)
    assert torch.equal(seq[:, :PROMPT], tiny.sample_ids(length=PROMPT))
    assert PROMPT < seq.shape[1] <= PROMPT + 3  # fewer than 3 new tokens only when an eos token was generated
    if tiny.has_rope(model.config):
        assert max(diffs) < 1e-4, f"cached != uncached: {diffs}"


@pytest.mark.parametrize("model_type", TYPES)
def test_family_builds_runs_and_generates_or_is_an_expected_failure(model_type):
    if model_type in tiny.EXPECTED_FAILURES:
        with pytest.raises(tiny.TinyBuildError, match=model_type):
            tiny.build_tiny(model_type)
        try:  # still failing, or the table is stale
            generate_and_check(tiny._build(model_type))
        except Exception:
            return
        pytest.fail(f"{model_type} now builds and generates: remove it from tiny.EXPECTED_FAILURES")
    model = tiny.build_tiny(model_type)
    assert not model.training
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert sum(p.numel() for p in model.parameters()) < MAX_PARAMS
    generate_and_check(model)


@pytest.mark.parametrize("model_type", [t for t in TYPES if t not in tiny.EXPECTED_FAILURES])
def test_tiny_config_keeps_the_family_layout(model_type):
    """Every kind of layer of the default survives the cut (a hybrid keeps attention and Mamba / linear attention,
    a MoE its dense and sparse layers), RoPE settings are the default's except the window, the trained window is
    WINDOW, and every special-token id lies inside the vocabulary."""
    default, config = default_config(model_type), tiny.tiny_config(model_type)
    text_default, text = vars(tiny.text_config(default)), vars(tiny.text_config(config))
    for name in PER_LAYER_KINDS:
        if isinstance(text_default.get(name), list):
            assert set(text[name]) == set(text_default[name]), name
            assert len(text[name]) == text.get("num_hidden_layers", len(text[name]))

    assert tiny.has_rope(config) == tiny.has_rope(default)
    assert without_window(text.get("rope_parameters")) == without_window(text_default.get("rope_parameters"))
    if tiny.has_rope(config) and text.get("max_position_embeddings"):
        assert trained_window(text) == tiny.WINDOW

    for sub in [config] + [v for v in vars(config).values() if hasattr(v, "to_dict")]:
        vocab = vars(sub).get("vocab_size")
        for name, value in sub.to_dict().items():
            if vocab and name.endswith("_token_id") and value is not None:
                assert all(0 <= v < vocab for v in (value if isinstance(value, list) else [value])), name


def without_window(params):
    """rope_parameters without what tiny.py moves: the window and M-RoPE sections (a split of the rotated half)."""
    if isinstance(params, dict):
        return {k: without_window(v) for k, v in params.items()
                if k not in ("original_max_position_embeddings", "max_position_embeddings", "mrope_section")}
    return params


def trained_window(text: dict) -> int:
    params = text.get("rope_parameters") or {}
    for p in [params] + [v for v in params.values() if isinstance(v, dict)]:
        if p.get("original_max_position_embeddings"):
            return p["original_max_position_embeddings"]
    return text.get("original_max_position_embeddings") or text["max_position_embeddings"]


def test_sizes_follow_the_rules():
    config = tiny.tiny_config("qwen3_moe")
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size, config.vocab_size, config.max_position_embeddings) == \
        (tiny.HIDDEN, tiny.LAYERS, tiny.HEADS, tiny.KV_HEADS, tiny.INTERMEDIATE, tiny.VOCAB, tiny.WINDOW)
    assert tiny.tiny_config("qwen3").head_dim == tiny.HEAD_DIM
    assert (config.num_experts, config.num_experts_per_tok) == (tiny.EXPERTS, tiny.TOP_K)
    gpt2 = tiny.tiny_config("gpt2")  # the same rules under another family's names
    assert (gpt2.n_embd, gpt2.n_layer, gpt2.n_head, gpt2.n_positions, gpt2.vocab_size) == \
        (tiny.HIDDEN, tiny.LAYERS, tiny.HEADS, tiny.WINDOW, tiny.VOCAB)


def test_mla_keeps_its_head_relations():
    """deepseek_v3 derives head_dim (the rotary size) from qk_rope_head_dim; dots3 derives partial_rotary_factor
    from qk_rope_head_dim / head_dim: both relations hold in the tiny configs."""
    v3 = tiny.tiny_config("deepseek_v3")
    assert v3.head_dim == v3.qk_rope_head_dim < v3.qk_rope_head_dim + v3.qk_nope_head_dim == tiny.HEAD_DIM
    assert v3.num_key_value_heads == v3.num_attention_heads  # MLA: keys and values per query head
    dots = tiny.tiny_config("dots3_note_text")
    assert dots.rope_parameters["sliding_attention"]["partial_rotary_factor"] == \
        default_config("dots3_note_text").rope_parameters["sliding_attention"]["partial_rotary_factor"]


def test_natively_scaled_rope_keeps_its_ratio():
    """gpt_oss ships YaRN x32 over a 4096 window: the tiny one is YaRN x32 over WINDOW."""
    config = tiny.tiny_config("gpt_oss")
    assert config.rope_parameters["rope_type"] == "yarn" and config.rope_parameters["factor"] == 32.0
    assert config.rope_parameters["original_max_position_embeddings"] == tiny.WINDOW
    assert config.max_position_embeddings == 32 * tiny.WINDOW


def test_overrides_win_and_seed_decides_the_weights():
    assert tiny.tiny_config("llama", num_hidden_layers=3, rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                           "rope_theta": 1e4}).num_hidden_layers == 3
    a, b, c = tiny.build_tiny("llama"), tiny.build_tiny("llama"), tiny.build_tiny("llama", seed=1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_bad_model_type_is_one_clear_error():
    with pytest.raises(ValueError, match=r"unknown model_type 'nope'.*CONFIG_MAPPING"):
        tiny.tiny_config("nope")
    with pytest.raises(tiny.TinyBuildError, match="musicgen: an audio-codebook decoder"):
        tiny.build_tiny("musicgen")


def test_rope_switched_off_is_no_rope():
    """granitemoehybrid and zamba2 carry rope_parameters but use them only when switched on."""
    for model_type, switch in (("granitemoehybrid", {"position_embedding_type": "rope"}),
                               ("zamba2", {"use_mem_rope": True})):
        assert not tiny.has_rope(tiny.tiny_config(model_type))
        assert not any("Rotary" in type(m).__name__ for m in tiny.build_tiny(model_type).modules())
        model = tiny.build_tiny(model_type, **switch)
        assert tiny.has_rope(model.config)
        assert any("Rotary" in type(m).__name__ for m in model.modules())
        generate_and_check(model)


@pytest.mark.parametrize("model_type,text_type", [("gemma3", "gemma3_text"), ("llava", "llama")])
def test_a_composite_config_is_refused_by_the_hand_sized_builder(model_type, text_type):
    # The sizes would stay on the composite's top level and its text model would be built full-sized (gemma3: 2.7 B
    # parameters, 13 GB in float32).
    with pytest.raises(ValueError, match=f"ask for the text model's own type \\('{text_type}'\\)"):
        tiny.sized_config(model_type)
    assert tiny.sized_config(text_type).get_text_config().hidden_size == 64
