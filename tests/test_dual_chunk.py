"""position="dual-chunk" against a reference written here from the paper (An et al. 2024): llama, qwen3 and gemma2
forwards computed by hand from their weights in float64 (tests/handref.py), with the intra-, successive- and
inter-chunk scores written out from the paper's position lists (GQA, padding, batch 2); cached decoding against the
full forward; a chunk at least as long as the sequence against the unpatched model; errors leave the model exactly
as it was."""

import pytest
import torch
from conftest import ROPE_FAMILIES, WINDOW, assert_same_fingerprint, fingerprint, logits, max_diff, tiny_model, tokens
from handref import by_hand, cached_and_full, gradients_by_name, padded, rope, skipping

import hfpatch
from hfpatch import tiny
from hfpatch.evaluate.common import parse_patches
from hfpatch.position.attention import paths
from hfpatch.position.schemes.dual_chunk import NAMES

# ------------------------------------------------------------------------------------------------ hand reference


def paper_positions(chunk_size, local_window, length):
    """The paper's position lists for one chunk of s = chunk_size - local_window queries, written out element by
    element: P_k = [0, 1, ..., s - 1] repeated, P_q^intra = P_k, P_q^succ = [s, s + 1, ..., s + w - 1, c - 1, ...,
    c - 1], P_q^inter = [c - 1, ...], with c - 1 = chunk_size - 1 the largest position."""
    s, w, top = chunk_size - local_window, local_window, chunk_size - 1
    key = [p % s for p in range(length)]
    succ = [(s + p % s) if p % s < w else top for p in range(length)]
    return key, key, succ, [top] * length


def dca_scores(chunk_size, local_window):
    def scores(q, k, pos, theta):
        """Per batch row: the key's chunk against the query's, from the row's positions."""
        s = chunk_size - local_window
        out = []
        for row in range(q.shape[0]):
            p = pos[row].tolist()
            table = paper_positions(chunk_size, local_window, max(p) + 1)
            pk, pi, ps, px = (torch.tensor([t[x] for x in p]) for t in table)
            key = rope(k[row:row + 1], pk[None], theta).transpose(-1, -2)
            intra, succ, inter = (rope(q[row:row + 1], t[None], theta) @ key for t in (pi, ps, px))
            chunk = torch.tensor(p) // s
            qc, kc = chunk[:, None], chunk[None, :]
            out.append(torch.where(kc == qc, intra, torch.where(kc == qc - 1, succ, inter)))
        return torch.cat(out)
    return scores


@pytest.mark.parametrize("family,attn,padding,C,w", [
    ("llama", "sdpa", "none", 24, 4),  # 90 tokens: chunks of 20, every kind of key
    ("llama", "sdpa", "left", 16, 3),  # the rows' chunks differ: positions count real tokens
    ("llama", "eager", "right", 24, 4),
    ("llama", "sdpa", "none", 9, 1),  # the smallest local window
    ("qwen3", "sdpa", "left", 32, 6),
    ("gemma2", "eager", "left", 20, 4),  # sliding layers (window 16)
    ("gemma2", "sdpa", "none", 24, 5),  # softcapping on the sdpa name: the written-out path
])
def test_equals_the_hand_computation(family, attn, padding, C, w):
    model = tiny_model(family, attn_implementation="eager" if family == "gemma2" else attn)
    ids, keep, pos = padded(90, padding)
    hfpatch.patch(model, position="dual-chunk", chunk_size=C, local_window=w)
    if attn == "sdpa" and family == "gemma2":  # transformers will not load gemma2 on sdpa (softcapping)
        model.config._attn_implementation_internal = NAMES.sdpa
    assert model.config._attn_implementation == (NAMES.eager if attn == "eager" else NAMES.sdpa)
    with torch.no_grad():
        out = model(ids, attention_mask=keep, position_ids=pos).logits
    expected = by_hand(model, ids, keep, pos, dca_scores(C, w))
    real = keep.bool()
    assert max_diff(out[real].double(), expected[real]) <= 1e-4
    unpatched = hfpatch.unpatch(model)(ids, attention_mask=keep, position_ids=pos).logits
    assert max_diff(unpatched[real], out[real]) > 1e-3  # the chunking is visible at this length


@pytest.mark.parametrize("family,attn", [("llama", "sdpa"), ("llama", "eager"), ("qwen3", "sdpa")])
def test_position_ids_that_skip_are_chunked_by_position(family, attn):
    """Chunks are cut by the positions: after a jump over whole chunks, the keys before it are inter-chunk keys
    however few slots back they are. The piece path's slot ranges follow the chunks (positions that only go up)."""
    model = hfpatch.patch(tiny_model(family, attn_implementation=attn), position="dual-chunk", chunk_size=16,
                          local_window=3)
    ids, keep, pos = skipping()
    paths.reset(model)
    with torch.no_grad():
        out = model(ids, attention_mask=keep, position_ids=pos).logits
    expected = by_hand(model, ids, keep, pos, dca_scores(16, 3))
    real = keep.bool()
    assert max_diff(out[real].double(), expected[real]) <= 1e-4
    assert paths.ran(model) == {"pieces" if attn == "sdpa" else "eager": 2}


@pytest.mark.parametrize("family", ROPE_FAMILIES)
def test_every_rope_family(family):
    """A chunk at least as long as the sequence is the unpatched model; the kernel pieces equal the written-out
    scores (the eager name): sliding windows (mistral, gemma2/3), per-layer-type RoPE (gemma3), partial rotary
    (gpt_neox); unpatch is exact."""
    model = tiny_model(family)
    x = tokens(120, batch=2)
    base = logits(model, x)
    hfpatch.patch(model, position="dual-chunk", chunk_size=WINDOW, local_window=1)
    n = WINDOW - 1
    assert max_diff(logits(model, x[:, :n]), base[:, :n]) <= 2e-6
    hfpatch.patch(model, position="dual-chunk", chunk_size=28, local_window=6)
    eager = hfpatch.patch(tiny_model(family, attn_implementation="eager"), position="dual-chunk", chunk_size=28,
                          local_window=6)
    assert eager.config._attn_implementation == NAMES.eager
    assert max_diff(logits(model, x), logits(eager, x)) <= 2e-5
    if model.config._attn_implementation == NAMES.sdpa and not getattr(model.config, "attn_logit_softcapping", None):
        assert set(hfpatch.describe(model)["position"]["attention_path"]["ran"]) == {"pieces"}
    hfpatch.unpatch(model)
    assert max_diff(logits(model, x), base) == 0.0


@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma3_text", "gpt_neox"])
def test_cached_decoding_equals_the_full_forward(family):
    """The cache holds un-rotated keys; each step rotates them. Padding on the left, as generate() pads; the chunk
    boundaries fall inside the cached part, the chunk of queries and between steps."""
    model = hfpatch.patch(tiny_model(family), position="dual-chunk", chunk_size=16, local_window=3)
    stepped, full, same = cached_and_full(model)
    assert max_diff(stepped, full) <= 1e-5
    assert same


def test_gradients_match_the_eager_path():
    """With gradients the sdpa name takes the written-out path; same gradients as the eager name."""
    grads = gradients_by_name(position="dual-chunk", chunk_size=12, local_window=2)
    assert grads["sdpa"].keys() == grads["eager"].keys()
    for n in grads["sdpa"]:
        assert torch.allclose(grads["sdpa"][n], grads["eager"][n], atol=1e-5), n
    assert grads["sdpa"]["model.layers.0.self_attn.q_proj.weight"].abs().sum() > 0


def test_distances_stay_below_the_chunk_size():
    """Every query-key distance the three maps make is below chunk_size, at any length; the successive map keeps
    the first local_window queries of a chunk at their true distance to the previous chunk."""
    from hfpatch.position.schemes import dual_chunk as dc

    C, w = 48, 5
    s = C - w
    pos = torch.arange(2000)
    i, j = pos[:, None], pos[None, :]
    qc, kc = i // s, j // s
    key = dc.key_positions(j, s)
    dist = torch.where(kc == qc, dc.intra_query_positions(i, s) - key,
                       torch.where(kc == qc - 1, dc.successive_query_positions(i, s, C) - key,
                                   dc.inter_query_positions(i, C) - key))
    causal = j <= i
    assert dist[causal].min() >= 0 and dist[causal].max() <= C - 1
    near = causal & (kc == qc - 1) & (i % s < w)
    assert torch.equal(dist[near], (i - j).expand_as(dist)[near])


# ---------------------------------------------------------------------------------------------- composes like any


def test_defaults_describe_unpatch_and_limits():
    model = tiny_model("llama")
    before = fingerprint(model)
    hfpatch.patch(model, position="dual-chunk")
    info = hfpatch.describe(model)
    path = info["position"].pop("attention_path")
    # the defaults: 3/4 and 1/16 of the trained window
    assert info["position"] == {"scheme": "dual-chunk", "chunk_size": WINDOW * 3 // 4, "local_window": WINDOW // 16,
                                "native": False}
    assert path["order"] == ["fa4", "pieces", "written-out"]
    assert info["position_limit"] is None and info["max_position_embeddings"] == WINDOW
    assert "dual-chunk" in info["patches"]["position"]
    hfpatch.patch(model, position="yarn", factor=2.0)  # replaces it
    assert type(model.model.rotary_emb).__name__ == "LlamaRotaryEmbedding"
    hfpatch.unpatch(model)
    assert_same_fingerprint(before, fingerprint(model))


def test_save_and_reload(tmp_path):
    from transformers import AutoModelForCausalLM

    model = hfpatch.patch(tiny_model("qwen3"), position="dual-chunk", chunk_size=20)
    x = tokens(100)
    with pytest.warns(UserWarning, match="plain transformers loads the model.s original position"):
        hfpatch.save_pretrained(model, tmp_path)
    again = hfpatch.from_pretrained(tmp_path)
    assert max_diff(logits(again, x), logits(model, x)) == 0.0
    assert hfpatch.describe(again)["position"]["local_window"] == WINDOW // 16
    plain = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert max_diff(logits(plain, x), logits(tiny_model("qwen3"), x)) == 0.0


def test_spec_strings():
    assert hfpatch.spec.parse("dual-chunk:chunk_size=48:local_window=4") == dict(position="dual-chunk",
                                                                                 chunk_size=48, local_window=4)
    [(_, kwargs)] = parse_patches("dual-chunk")
    assert hfpatch.spec.request(**kwargs)["position"] == {"scheme": "dual-chunk"}


BAD = [
    (dict(chunk_size=0), "chunk_size must be a positive integer, got 0"),
    (dict(chunk_size=2.5), "chunk_size must be a positive integer"),
    (dict(local_window=-3), "local_window must be a positive integer"),
    (dict(chunk_size=WINDOW + 1), f"chunk_size={WINDOW + 1} is beyond the {WINDOW} tokens llama was trained on"),
    (dict(chunk_size=16, local_window=16), "local_window=16 must be smaller than chunk_size=16"),
    (dict(local_window=WINDOW), f"local_window={WINDOW} must be smaller than chunk_size={WINDOW * 3 // 4}"),
    (dict(factor=2.0), "does not take factor"),
    (dict(group_size=4), "does not take group_size"),
]


@pytest.mark.parametrize("kwargs,message", BAD, ids=[m for _, m in BAD])
def test_bad_options_leave_the_model_untouched(kwargs, message):
    model = tiny_model("llama")
    before = fingerprint(model)
    with pytest.raises(ValueError, match=message):
        hfpatch.patch(model, position="dual-chunk", **kwargs)
    assert_same_fingerprint(before, fingerprint(model))


@pytest.mark.parametrize("family,message", [("gpt2", "is a RoPE scheme, but gpt2 has learned absolute position"),
                                            ("bert", "is a RoPE scheme")])
def test_models_without_rope_are_refused(family, message):
    model = tiny_model(family)
    before = fingerprint(model)
    with pytest.raises(ValueError, match=message):
        hfpatch.patch(model, position="dual-chunk")
    assert_same_fingerprint(before, fingerprint(model))


@pytest.mark.parametrize("family", ["doge", "qwen4_exp"])
def test_cached_decoding_where_the_family_chooses_the_keys(family):
    """doge adds a learned bias to its mask and qwen4_exp's indexer hides key blocks from a query, the newest slot
    included: neither is an empty static-cache slot, so cached steps run and equal the full forward."""
    model = hfpatch.patch(tiny.build_tiny(family), position="dual-chunk", chunk_size=16, local_window=2)
    stepped, full = tiny.stepped_and_full(model)
    assert max_diff(stepped, full) <= 1e-5
    ids = tiny.sample_ids(length=24)
    out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
    assert out.shape[1] > ids.shape[1]


def test_a_model_without_a_trained_window_is_refused_with_the_reason():
    """recurrent_gemma attends locally and its config names no window to take the defaults and the limit from."""
    model = tiny.build_tiny("recurrent_gemma")
    assert "dual-chunk" not in hfpatch.supported(model)["patches"]["position"]  # (its probe forward sets the state)
    before = fingerprint(model)
    with pytest.raises(ValueError, match="recurrent_gemma's config names none"):
        hfpatch.patch(model, position="dual-chunk")
    assert_same_fingerprint(before, fingerprint(model))


def test_a_static_cache_is_refused_with_a_clear_error():
    model = hfpatch.patch(tiny_model("llama"), position="dual-chunk", chunk_size=16, local_window=2)
    with pytest.raises(ValueError, match=r"a DynamicCache, what generate\(\) uses by default"):
        model.generate(tokens(20), max_new_tokens=2, do_sample=False, pad_token_id=0, cache_implementation="static")
