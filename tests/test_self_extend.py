"""position="self-extend" against a reference written here from the paper: llama, qwen3 and gemma2 forwards computed
by hand from their weights in float64, with the neighbour / grouped attention written out (GQA, padding, batch 2);
G = 1 and a window covering everything against the unpatched model; errors leave the model exactly as it was.
Cached decoding, gradients and the refusals it shares with Dual Chunk Attention are in tests/test_window_schemes.py."""

import copy

import pytest
import torch
from conftest import ROPE_FAMILIES, WINDOW, assert_refused, leaves_unchanged, logits, max_diff, tiny_model, tokens
from handref import (
    assert_unpatched_differs,
    by_hand,
    padded,
    patched_logits_by_hand,
    patched_on,
    rope,
    segmented,
    skipping,
)
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding, apply_rotary_pos_emb  # noqa: F401 (the attention below rotates with it)

import hfpatch
from hfpatch.evaluate.common import parse_patches
from hfpatch.position.attention import paths
from hfpatch.position.schemes import rotated, self_extend
from hfpatch.position.schemes.self_extend import EAGER_NAME, SDPA_NAME

# ------------------------------------------------------------------------------------------------ hand reference


def self_extend_scores(G, W):
    """Jin et al. 2024: per (query, key) pair, for positions p_i - p_j < W the scores of RoPE at the true positions,
    else of the query at floor(p_i / G) + W - floor(W / G) and the key at floor(p_j / G)."""
    def scores(q, k, pos, theta):
        near = rope(q, pos, theta) @ rope(k, pos, theta).transpose(-1, -2)
        far = rope(q, pos // G + W - W // G, theta) @ rope(k, pos // G, theta).transpose(-1, -2)
        return torch.where((pos[:, :, None] - pos[:, None, :] < W)[:, None], near, far)
    return scores


@pytest.mark.parametrize("family,attn,padding,G,W", [
    ("llama", "sdpa", "none", 4, 16),
    ("llama", "sdpa", "left", 3, 8),  # G does not divide W: the regions meet at W or W + 1
    ("llama", "eager", "right", 4, 16),
    ("llama", "sdpa", "none", 2, 1),  # the smallest window: each token is its only neighbour
    ("qwen3", "sdpa", "left", 4, 16),
    ("gemma2", "eager", "left", 4, 12),  # sliding layers (window 16) see grouped keys too
    ("gemma2", "sdpa", "none", 3, 8),  # softcapping on the sdpa name: the explicit path, blocked
])
def test_equals_the_hand_computation(family, attn, padding, G, W):
    model = patched_on(family, attn, (EAGER_NAME, SDPA_NAME), position="self-extend", group_size=G, window=W)
    ids, keep, pos = padded(90, padding)
    out = patched_logits_by_hand(model, ids, keep, pos, self_extend_scores(G, W))
    assert_unpatched_differs(model, ids, keep, pos, out)  # the grouping is visible at this length


@pytest.mark.parametrize("family,attn", [("llama", "sdpa"), ("llama", "eager"), ("qwen3", "sdpa")])
def test_position_ids_that_skip_are_grouped_by_the_distance_of_the_positions(family, attn):
    """A key a few slots before a jump of the position ids is far from the queries after it: the paper's regions are
    by position distance. The sdpa name cuts its pieces by the positions."""
    model = hfpatch.patch(tiny_model(family, attn_implementation=attn), position="self-extend", group_size=4, window=8)
    ids, keep, pos = skipping()
    paths.reset(model)
    patched_logits_by_hand(model, ids, keep, pos, self_extend_scores(4, 8))
    assert paths.ran(model) == {"pieces" if attn == "sdpa" else "eager": 2}


SKIPS = {  # segment lengths, the jumps of the positions between them (1: none), padding of the second row; W = 8
    "2 segments, a jump beyond W": ([48, 48], [300], "none"),
    "16 segments shorter than W, jumps below and beyond W": ([6] * 16, [3, 20] * 7 + [3], "left"),
    "4 segments longer than W, jumps below W": ([24] * 4, [5, 2, 7], "right"),
    "segments of 1 to 30 tokens, jumps of 1 to 40": ([1, 30, 5, 9, 2, 17, 8, 24], [40, 1, 9, 8, 3, 12, 2], "left"),
}


@pytest.mark.parametrize("pattern", list(SKIPS))
def test_position_ids_that_skip_take_the_piece_path(pattern):
    """PoSE-style position ids (segments whose positions jump) run the piece path, its blocks cut by the positions,
    and give the hand computation and the written-out path: the batch at once where its rows share their positions,
    a row at a time where padding shifts them."""
    lengths, jumps, padding = SKIPS[pattern]
    model = hfpatch.patch(tiny_model("llama"), position="self-extend", group_size=3, window=8)
    ids, keep, pos = segmented(lengths, jumps, padding)
    paths.reset(model)
    with torch.no_grad():
        out = model(ids, attention_mask=keep, position_ids=pos).logits
        assert paths.ran(model) == {"pieces": model.config.num_hidden_layers}
        with paths.forcing("self-extend", "written-out"):
            written = model(ids, attention_mask=keep, position_ids=pos).logits
    expected = by_hand(model, ids, keep, pos, self_extend_scores(3, 8))
    real = keep.bool()
    assert max_diff(out[real].double(), expected[real]) <= 1e-4
    assert max_diff(out[real], written[real]) <= 2e-5


def attention_inputs(model, batch, length, dtype=torch.float32, seed=0):
    """(attention module, q, k, v) of random values shaped for `model`'s first layer."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, h, length, cfg.head_dim, generator=g, dtype=dtype)
               for h in (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_key_value_heads))
    return model.model.layers[0].self_attn, q, k, v


def run_forced(name, attn, q, k, v, mask, pos):
    with paths.forcing("self-extend", name), torch.no_grad():
        return paths.run("self-extend", attn, q, k, v, mask, scaling=0.25, dropout=0.0, causal=True,
                         kwargs={"position_ids": pos})[0]


@pytest.mark.parametrize("window", [1, 5, 8, 40])
@pytest.mark.parametrize("mask", ["none", "bool", "bool, padded", "float, padded"])
def test_the_piece_path_by_positions_equals_the_written_out_path(window, mask, monkeypatch):
    """Float64, grouped-query attention: random non-decreasing positions (jumps of 0 to 3W, so repeated positions
    too), blocks of at most 7 queries (fewer than the window, as well as more); rows that share their positions (no
    mask, or a mask without padding) and rows that do not (the second left-padded, its padded slots at position 0)."""
    monkeypatch.setattr(self_extend, "PIECE_ROWS", 7)
    model = hfpatch.patch(tiny_model("llama"), position="self-extend", group_size=3, window=window)
    attn, q, k, v = attention_inputs(model, 2, 80, torch.float64)
    g = torch.Generator().manual_seed(window)
    jumps = torch.randint(0, 3 * window + 1, (80,), generator=g) * (torch.rand(80, generator=g) < 0.3)
    pos = torch.stack([jumps.cumsum(0)] * 2)
    keep = torch.ones(2, 80, dtype=torch.bool)
    if mask.endswith("padded"):
        keep[1, :11] = False
        pos[1] = torch.cat([torch.zeros(11, dtype=torch.long), pos[0, :-11]])
    allowed = (torch.ones(80, 80, dtype=torch.bool).tril()[None] & keep[:, None, :])[:, None]
    given = (None if mask == "none" else allowed if mask.startswith("bool")
             else torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, float("-inf")))
    got = run_forced("pieces", attn, q, k, v, given, pos)
    want = run_forced("written-out", attn, q, k, v, given, pos)
    assert max_diff(got[keep], want[keep]) <= 1e-12
    assert not self_extend.contiguous_positions(pos, pos, given)  # the blocks were cut by the positions


ON_CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                           reason="needs a CUDA device")])


@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_piece_path_by_positions_in_each_dtype(device, dtype):
    """The kernels each device runs (on CUDA flash for unmasked bf16 pieces, memory-efficient for the masked ones):
    PoSE-style positions, rows that share them without a mask and a left-padded row with one, against the
    written-out path, relative to the largest output (test_attention_paths.py's bounds: the two round differently
    in bf16)."""
    model = hfpatch.patch(tiny_model("llama"), position="self-extend", group_size=3, window=8).to(device, dtype)
    _, keep, pos = segmented([6] * 16, [3, 20] * 7 + [3], "left")
    attn, q, k, v = (t.to(device) for t in attention_inputs(model, 2, 96, dtype))
    real = keep.bool().to(device)
    allowed = (torch.ones(96, 96, dtype=torch.bool, device=device).tril()[None] & real[:, None, :])[:, None]
    for given, p, rows in ((None, pos[:1].expand(2, -1), torch.ones_like(real)), (allowed, pos, real)):
        got = run_forced("pieces", attn, q, k, v, given, p.to(device))
        want = run_forced("written-out", attn, q, k, v, given, p.to(device))
        bound = {torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
        assert max_diff(got[rows].float(), want[rows].float()) <= bound * want[rows].float().abs().max().item()


def test_position_blocks_bound_the_keys_that_need_a_mask():
    """Each block: at most PIECE_ROWS queries within W - 1 positions of its first (its own keys are neighbours of
    each), keys [0, a) grouped and [c, s) neighbours for all of its queries; the keys between, the only ones attended
    with a [block, keys] mask, are at most W - 1 for distinct positions, however the positions jump."""
    g = torch.Generator().manual_seed(0)
    for window in (1, 3, 16, 100):
        for trial in range(20):
            jumps = 1 + torch.randint(0, 4 * window, (300,), generator=g) * (torch.rand(300, generator=g) < 0.2)
            pos = (jumps.cumsum(0) - 1).tolist()
            q_len = 300 - trial * 7  # cached keys before the queries too
            covered = []
            for s, e, a, c in self_extend.position_blocks(pos, q_len, window):
                covered += range(s, e)
                assert e - s <= self_extend.PIECE_ROWS and pos[e - 1] - pos[s] < window
                assert all(pos[j] <= pos[s] - window for j in range(a))
                assert all(pos[j] > pos[e - 1] - window for j in range(c, s))
                assert a <= c <= s and c - a <= window - 1
            assert covered == list(range(300 - q_len, 300))


def _refused_then_run(model, call, pos, refusing, match):
    """The path `refusing` of Self-Extend's table raises PathUnavailable (matching `match`) for the attention call
    `call` = (module, q, k, v) with position ids `pos`; the table then runs the call: {the path that ran: 1}."""
    attn, q, k, v = call
    path = next(p for p in paths.table("self-extend") if p.name == refusing)
    with torch.no_grad(), pytest.raises(paths.PathUnavailable, match=match):
        path.run(attn, q, k, v, None, scaling=0.25, dropout=0.0, causal=True, softcap=None,
                 kwargs={"position_ids": pos})
    paths.reset(model)
    with torch.no_grad():
        paths.run("self-extend", attn, q, k, v, None, scaling=0.25, dropout=0.0, causal=True,
                  kwargs={"position_ids": pos})
    return paths.ran(model)


def test_the_piece_path_refuses_positions_that_go_back():
    """Packed documents (positions that start again) are no order the blocks can be cut by: the written-out path
    takes the call."""
    model = hfpatch.patch(tiny_model("llama"), position="self-extend", group_size=4, window=8)
    attn, q, k, v = attention_inputs(model, 1, 48)
    pos = torch.cat([torch.arange(20), torch.arange(28)])[None]
    assert _refused_then_run(model, (attn, q, k, v), pos, "pieces", "position ids that go back") == {"written-out": 1}


def test_slot_positions_count_the_slots_some_query_sees():
    """What the piece path cuts its blocks by: the key slots' positions where they never go down over the slots some
    query sees; a padded slot takes its seen neighbour's position; cached keys must meet the queries' positions."""
    slots = torch.arange(10)
    causal = (slots[None, :] <= slots[:, None])[None, None]
    skip = torch.tensor([[0, 1, 2, 50, 51, 52, 53, 90, 91, 92]])
    assert torch.equal(self_extend.slot_positions(skip, skip, None), skip)
    left = torch.tensor([[0, 0, 0, 7, 8, 50, 51, 52, 53, 54]])  # three padded slots at position 0
    assert torch.equal(self_extend.slot_positions(left, left, causal & (slots >= 3)),
                       torch.tensor([[7, 7, 7, 7, 8, 50, 51, 52, 53, 54]]))
    right = torch.tensor([[0, 1, 2, 50, 51, 52, 53, 0, 0, 0]])  # right padding: no query sees the padded keys
    assert torch.equal(self_extend.slot_positions(right, right, causal & (slots < 7)),
                       torch.tensor([[0, 1, 2, 50, 51, 52, 53, 53, 53, 53]]))
    assert self_extend.slot_positions(right, right, None) is None  # without a mask every slot counts
    back = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4]])
    assert self_extend.slot_positions(back, back, causal) is None
    k_pos = torch.arange(20, 30)[None]  # queries after cached keys, which continue the newest query's position back
    assert torch.equal(self_extend.slot_positions(k_pos[:, -3:], k_pos, None), k_pos)
    assert self_extend.slot_positions(torch.tensor([[7, 28, 29]]), k_pos, None) is None


@pytest.mark.parametrize("padding", ["none", "left", "right"])
def test_contiguous_positions_take_the_piece_path(padding):
    """Positions one per slot over the real tokens, whatever the padded slots carry (the count of real tokens, or 0 as
    generate() gives them), and generate()'s cached steps: slot distances are position distances there."""
    model = hfpatch.patch(tiny_model("llama"), position="self-extend", group_size=3, window=8)
    ids, keep, pos = padded(60, padding)
    paths.reset(model)
    with torch.no_grad():
        for p in (pos, pos.masked_fill(keep == 0, 0)):
            model(ids, attention_mask=keep, position_ids=p)
        if padding != "right":
            model.generate(ids, attention_mask=keep, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert set(paths.ran(model)) == {"pieces"}


def test_contiguity_counts_the_slots_some_query_sees():
    """The decision the slot-cut paths (pieces, flex, flash-attn) take: position - slot one constant per batch row
    over the slots the mask lets some query see; padded slots carry anything."""
    contiguous = self_extend.contiguous_positions
    slots = torch.arange(10)
    causal = (slots[None, :] <= slots[:, None])[None, None]
    as_float = lambda m: torch.zeros(m.shape).masked_fill(~m, torch.finfo(torch.float32).min)
    skip = torch.cat([torch.arange(5), torch.arange(100, 105)])[None]
    assert contiguous(slots[None], slots[None], None)
    assert contiguous(torch.stack([slots, slots + 7]), torch.stack([slots, slots + 7]), None)  # an offset per row
    assert not contiguous(skip, skip, None) and not contiguous(skip, skip, causal)
    left = torch.tensor([[0, 0, 0, 0, 1, 2, 3, 4, 5, 6]])  # three padded slots at position 0
    padded_mask = causal & (slots >= 3)
    assert contiguous(left, left, padded_mask) and contiguous(left, left, as_float(padded_mask))
    assert not contiguous(left, left, None)  # without a mask every slot counts
    left_skip = torch.tensor([[0, 0, 0, 0, 1, 2, 50, 51, 52, 53]])
    assert not contiguous(left_skip, left_skip, padded_mask)
    right = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 0, 0, 0]])  # right padding: the padded keys are seen by no query
    assert contiguous(right, right, causal & (slots < 7))
    nothing = torch.zeros(1, 1, 10, 10, dtype=torch.bool)
    assert contiguous(skip, skip, nothing)  # a row that sees no key attends nothing
    for q_pos, expected in ((torch.tensor([[29]]), True), (torch.tensor([[27, 28, 29]]), True),
                            (torch.tensor([[7, 28, 29]]), False)):  # queries after 20 cached keys
        q, k = rotated.positions(q_pos, 1, q_pos.shape[1], 30, q_pos.device)
        assert contiguous(q, k, None) is expected, q_pos


@pytest.mark.parametrize("name", ["flash-attn", "flex"])
def test_the_slot_cut_paths_refuse_position_ids_that_skip(name):
    """Each raises PathUnavailable before it computes anything (flash-attn and flex run on CUDA only: their refusal
    comes first, so it is seen here); the table then runs the piece path, which cuts its blocks by the positions."""
    model = hfpatch.patch(tiny_model("llama"), position="self-extend", group_size=4, window=8)
    attn, q, k, v = attention_inputs(model, 1, 48)
    pos = skipping()[2][:1]
    assert _refused_then_run(model, (attn, q, k, v), pos, name, "position ids that skip") == {"pieces": 1}


def test_a_compiled_call_whose_positions_skip_stops_with_an_error():
    """A compiled graph cannot leave the piece path by the positions' values: contiguous positions run it (no graph
    break), positions that skip raise instead of being attended by slot distance."""
    model = hfpatch.patch(tiny_model("llama"), position="self-extend", group_size=4, window=8)
    attn, q, k, v = attention_inputs(model, 1, 48)

    def attend(pos):
        return paths.run("self-extend", attn, q, k, v, None, scaling=0.25, dropout=0.0, causal=True,
                         kwargs={"position_ids": pos})[0]

    torch._dynamo.reset()
    compiled = torch.compile(attend, backend="eager", fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(torch.arange(48)[None]), attend(torch.arange(48)[None]))
        with pytest.raises(RuntimeError, match="these position ids skip"):
            compiled(skipping()[2][:1])


@pytest.mark.parametrize("family", ROPE_FAMILIES)
def test_every_rope_family(family):
    """G = 1, or a window covering the sequence, is the unpatched model; the log-sum-exp merge of flash-attention
    pieces equals the written-out scores (the eager name): sliding windows (mistral, gemma2/3), per-layer-type RoPE
    (gemma3), partial rotary (gpt_neox); unpatch is exact."""
    model = tiny_model(family)
    x = tokens(120, batch=2)
    base = logits(model, x)
    hfpatch.patch(model, position="self-extend", group_size=1, window=8)
    assert max_diff(logits(model, x), base) <= 2e-6
    hfpatch.patch(model, position="self-extend", group_size=8, window=WINDOW)
    assert max_diff(logits(model, x[:, :WINDOW]), base[:, :WINDOW]) <= 2e-6
    hfpatch.patch(model, position="self-extend", group_size=4, window=20)
    eager = hfpatch.patch(tiny_model(family, attn_implementation="eager"), position="self-extend", group_size=4,
                          window=20)
    assert eager.config._attn_implementation == EAGER_NAME
    assert max_diff(logits(model, x), logits(eager, x)) <= 2e-5
    hfpatch.unpatch(model)
    assert max_diff(logits(model, x), base) == 0.0


# ---------------------------------------------------------------------------------------------- composes like any


def test_describe_unpatch_and_limits():
    model = tiny_model("llama")
    with leaves_unchanged(model):
        hfpatch.patch(model, position="self-extend", group_size=4, window=16)
        info = hfpatch.describe(model)
        path = info["position"].pop("attention_path")
        assert info["position"] == {"scheme": "self-extend", "group_size": 4, "window": 16, "native": False}
        assert path["order"] == ["fa4", "flash-attn", "flex", "pieces", "written-out"]
        assert path["ran"] == {}  # counted from the patch on: its own check's forward is not
        with torch.no_grad():
            model(tokens(20))
        ran = hfpatch.describe(model)["position"]["attention_path"]["ran"]
        assert set(ran) == {"pieces"}  # on this CPU, without gradients
        assert info["position_limit"] == info["max_position_embeddings"] == (WINDOW - 16) * 4 + 16
        assert "self-extend" in info["patches"]["position"]
        hfpatch.patch(model, position="yarn", factor=2.0)  # replaces it
        assert type(model.model.rotary_emb).__name__ == "LlamaRotaryEmbedding"
        hfpatch.unpatch(model)


def test_save_and_reload(tmp_path):
    from transformers import AutoModelForCausalLM

    model = hfpatch.patch(tiny_model("qwen3"), position="self-extend", group_size=4, window=16)
    x = tokens(100)
    with pytest.warns(UserWarning, match="plain transformers loads the model.s original position"):
        hfpatch.save_pretrained(model, tmp_path)
    assert max_diff(logits(hfpatch.from_pretrained(tmp_path), x), logits(model, x)) == 0.0
    plain = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert max_diff(logits(plain, x), logits(tiny_model("qwen3"), x)) == 0.0


def test_no_options_use_the_default_rule():
    """G = DEFAULT_GROUP_SIZE and W = the trained window / DEFAULT_WINDOW_FRACTION, shown by describe(), restored by
    a reload; one option given keeps the other's default."""
    model = hfpatch.patch(tiny_model("llama"), position="self-extend")
    G, W = self_extend.DEFAULT_GROUP_SIZE, WINDOW // self_extend.DEFAULT_WINDOW_FRACTION
    info = hfpatch.describe(model)
    assert (info["position"]["group_size"], info["position"]["window"]) == (G, W)
    assert info["max_position_embeddings"] == (WINDOW - W) * G + W
    x = tokens(150)
    explicit = hfpatch.patch(tiny_model("llama"), position="self-extend", group_size=G, window=W)
    assert max_diff(logits(model, x), logits(explicit, x)) == 0.0
    hfpatch.patch(model, position="self-extend", window=8)
    assert (hfpatch.describe(model)["position"]["group_size"], hfpatch.describe(model)["position"]["window"]) == (G, 8)


def test_spec_strings():
    assert hfpatch.spec.parse("self-extend:group_size=4:window=1024") == dict(position="self-extend", group_size=4,
                                                                             window=1024)
    [(_, kwargs)] = parse_patches("self-extend:group_size=8:window=1024")
    assert hfpatch.spec.request(**kwargs)["position"] == {"scheme": "self-extend", "group_size": 8, "window": 1024}


BAD = [
    (dict(group_size=0, window=16), "group_size must be a positive integer, got 0"),
    (dict(group_size=2.5, window=16), "group_size must be a positive integer"),
    (dict(group_size=4, window=0), "window must be a positive integer, got 0"),
    (dict(group_size=4, window=-3), "window must be a positive integer"),
    (dict(group_size=4, window=WINDOW + 1), f"window={WINDOW + 1} is beyond the {WINDOW} tokens llama was trained on"),
    (dict(group_size=4, window=WINDOW * 2), f"window={WINDOW * 2} is beyond"),
    (dict(group_size=4, window=16, factor=2.0), "does not take factor"),
]


@pytest.mark.parametrize("kwargs,message", BAD, ids=[m for _, m in BAD])
def test_bad_options_leave_the_model_untouched(kwargs, message):
    assert_refused(tiny_model("llama"), message, position="self-extend", **kwargs)


class OwnRopeAttention(LlamaAttention):
    """An attention that computes RoPE itself from position_ids instead of using the rotary module's cos/sin."""

    def forward(self, hidden_states, position_embeddings=None, **kwargs):
        return super().forward(hidden_states, self.own_rotary(hidden_states, kwargs["position_ids"]), **kwargs)


def test_an_attention_it_cannot_reproduce_is_refused():
    model = tiny_model("llama")
    own = LlamaRotaryEmbedding(model.config)
    for layer in model.model.layers:
        layer.self_attn.__class__ = OwnRopeAttention
        object.__setattr__(layer.self_attn, "own_rotary", own)  # not a submodule: the model has one rotary
    assert_refused(model, "does not reproduce llama's own RoPE attention", position="self-extend",
                             group_size=4, window=16)


def test_position_maps_meet_at_the_window():
    """At i - j = W the grouped distance is W when G divides W (W + 1 at most otherwise), and beyond the window it
    grows G times slower."""
    pos = torch.arange(5000)
    for G, W in [(4, 1024), (3, 8), (8, 100), (1, 7)]:
        i, j = pos[W:], pos[:-W]
        d = self_extend.grouped_query_positions(i, G, W) - self_extend.grouped_key_positions(j, G)
        assert d.min() >= W and d.max() <= W + (W % G != 0)
        far = self_extend.grouped_query_positions(pos[-1:], G, W) - self_extend.grouped_key_positions(pos[:1], G)
        assert abs(far.item() - (W + (4999 - W) / G)) <= 2


def test_a_deep_copy_rotates_with_its_own_rotary_module():
    model = hfpatch.patch(tiny_model("llama"), position="self-extend", group_size=4, window=16)
    x = tokens(80)
    patched = logits(model, x)
    twin = copy.deepcopy(model)
    assert getattr(twin.model.layers[0].self_attn, self_extend.STATE_ATTR).rotation.rotary is twin.model.rotary_emb
    assert max_diff(logits(twin, x), patched) == 0.0
    hfpatch.unpatch(twin)
    assert max_diff(logits(twin, x), logits(tiny_model("llama"), x)) == 0.0
    assert max_diff(logits(model, x), patched) == 0.0
