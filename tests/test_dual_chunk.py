"""position="dual-chunk" against a reference written here from the paper (An et al. 2024): llama, qwen3 and gemma2
forwards computed by hand from their weights in float64 (tests/handref.py), with the intra-, successive- and
inter-chunk scores written out from the paper's position lists (GQA, padding, batch 2); a chunk at least as long as
the sequence against the unpatched model; errors leave the model exactly as it was. Cached decoding, gradients and the
refusals it shares with Self-Extend are in tests/test_window_schemes.py."""

import pytest
import torch
from conftest import ROPE_FAMILIES, WINDOW, assert_refused, leaves_unchanged, logits, max_diff, tiny_model, tokens
from handref import assert_unpatched_differs, padded, patched_logits_by_hand, patched_on, rope, skipping

import hfpatch
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
    model = patched_on(family, attn, (NAMES.eager, NAMES.sdpa), position="dual-chunk", chunk_size=C, local_window=w)
    ids, keep, pos = padded(90, padding)
    out = patched_logits_by_hand(model, ids, keep, pos, dca_scores(C, w))
    assert_unpatched_differs(model, ids, keep, pos, out)  # the chunking is visible at this length


@pytest.mark.parametrize("family,attn", [("llama", "sdpa"), ("llama", "eager"), ("qwen3", "sdpa")])
def test_position_ids_that_skip_are_chunked_by_position(family, attn):
    """Chunks are cut by the positions: after a jump over whole chunks, the keys before it are inter-chunk keys
    however few slots back they are. The piece path's slot ranges follow the chunks (positions that only go up)."""
    model = hfpatch.patch(tiny_model(family, attn_implementation=attn), position="dual-chunk", chunk_size=16,
                          local_window=3)
    ids, keep, pos = skipping()
    paths.reset(model)
    patched_logits_by_hand(model, ids, keep, pos, dca_scores(16, 3))
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
    with leaves_unchanged(model):
        hfpatch.patch(model, position="dual-chunk")
        info = hfpatch.describe(model)
        path = info["position"].pop("attention_path")
        # the defaults: 3/4 and 1/16 of the trained window
        assert info["position"] == {"scheme": "dual-chunk", "chunk_size": WINDOW * 3 // 4,
                                    "local_window": WINDOW // 16, "native": False}
        assert path["order"] == ["fa4", "pieces", "written-out"]
        assert info["position_limit"] is None and info["max_position_embeddings"] == WINDOW
        assert "dual-chunk" in info["patches"]["position"]
        hfpatch.patch(model, position="yarn", factor=2.0)  # replaces it
        assert type(model.model.rotary_emb).__name__ == "LlamaRotaryEmbedding"
        hfpatch.unpatch(model)


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
    assert_refused(tiny_model("llama"), message, position="dual-chunk", **kwargs)
