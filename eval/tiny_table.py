"""Every causal-LM model_type of the installed transformers, as a tiny model (hfpatch.tiny): does it build, run and
generate on a CPU, what RoPE it carries and how its rotary embedding is laid out, what kinds of layers it stacks
(read off the cache a forward pass fills), whether it is MoE, and whether cached greedy decoding matches uncached
forwards. Prints a Markdown table and the counts.

    python -m eval.tiny_table                 # all types
    python -m eval.tiny_table llama gemma3    # some
    python -m eval.tiny_table --threads 2     # torch intra-op threads (default 1)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import time

import torch

from eval.benchutil import markdown_table
from hfpatch import tiny

# What one layer of a transformers cache holds (cache_utils classes, measured on the filled cache of a forward).
CACHE_KINDS = {
    "DynamicLayer": "full", "DynamicSlidingWindowLayer": "sliding", "DynamicIndexedLayer": "indexed",
    "LinearAttentionLayer": "state", "LinearAttentionAndFullAttentionLayer": "state+full",
    "LinearAttentionAndSlidingWindowAttentionLayer": "state+sliding", "DummyLayer": "kv-shared",
}
# Per-layer kinds in configs that carry a recurrent state instead of (or besides) attention.
STATE_KINDS = {"linear_attention", "conv", "recurrent", "mamba", "hybrid", "hybrid_sliding"}
MIXER_NAMES = ("layer_types", "layers_block_type", "block_types")


def rope_types(text: dict) -> str:
    params = text.get("rope_parameters")
    if not params:
        return "-"
    if any(isinstance(v, dict) for v in params.values()):
        return ", ".join(f"{k}: {v.get('rope_type', '?')}" if v else f"{k}: none" for k, v in params.items())
    return params.get("rope_type", "?")


def rotary_layout(model, text: dict) -> str:
    """Facts a RoPE patcher must know, read off the built model and its config."""
    notes = []
    rotaries = [m for m in model.modules() if "Rotary" in type(m).__name__]
    if len(rotaries) > 1:
        notes.append(f"{len(rotaries)} rotary modules")
    params = text.get("rope_parameters") or {}
    buffers = {n for m in rotaries for n, _ in m.named_buffers(recurse=False)}
    per_type = [k for k in params if f"{k}_inv_freq" in buffers]  # gemma3-style: one module, a buffer per type
    if per_type:
        notes.append("inv_freq per layer type (" + ", ".join(per_type) + ")")
    flat = [params] + [v for v in params.values() if isinstance(v, dict)]
    factors = sorted({p["partial_rotary_factor"] for p in flat if p.get("partial_rotary_factor", 1.0) != 1.0})
    if factors:
        notes.append("partial " + "/".join(f"{f:g}" for f in factors))
    if text.get("rotary_dim"):
        notes.append(f"rotary_dim {text['rotary_dim']}")
    if text.get("kv_lora_rank"):
        qk = text["qk_rope_head_dim"] + text["qk_nope_head_dim"]
        notes.append(f"MLA: rotates {text['qk_rope_head_dim']} of {qk}")
    return "; ".join(notes) or "-"


@torch.no_grad()
def layer_kinds(model, text: dict) -> tuple[str, bool]:
    """The kinds of layers of the stack, from the cache a forward fills (and the config's per-layer kinds where
    the state lives outside that cache); hybrid = attention and a recurrent state both present."""
    out = model(tiny.sample_ids(), use_cache=True)
    cache = getattr(out, "past_key_values", None) or getattr(out, "cache_params", None)  # mamba: cache_params
    kinds = {CACHE_KINDS.get(type(layer).__name__, type(layer).__name__) for layer in getattr(cache, "layers", [])}
    declared = {k for name in MIXER_NAMES for k in (text.get(name) or []) if isinstance(k, str)}
    state = any("state" in k for k in kinds) or bool(declared & STATE_KINDS)
    attention = any(k.split("+")[-1] in ("full", "sliding", "indexed") for k in kinds) or bool(declared - STATE_KINDS)
    if not kinds:
        kinds = declared or {f"{type(cache).__name__ if cache is not None else 'no'} cache"}
    return ", ".join(sorted(kinds)), state and attention


def build(model_type: str):
    """build_tiny (which runs one forward pass), or the exception that stopped it."""
    try:
        return tiny.build_tiny(model_type)
    except tiny.TinyBuildError as e:
        return e


def row(model_type: str, model) -> dict:
    try:
        if isinstance(model, Exception):
            raise model
        text = vars(tiny.text_config(model.config))
        with contextlib.redirect_stdout(io.StringIO()):  # reformer's generate prints to stdout
            _, diffs = tiny.greedy_check(model)
    except Exception as e:  # TinyBuildError, or a generate that fails
        config = None
        with contextlib.suppress(Exception):  # a type without a tiny config: no RoPE answer either
            config = tiny.tiny_config(model_type)
        reason = tiny.EXPECTED_FAILURES.get(model_type) or tiny._one_line(e)
        rope = tiny.has_rope(config) if config is not None else None
        return {"type": model_type, "builds": False, "reason": reason, "rope": rope}
    kinds, hybrid = layer_kinds(model, text)
    return {"type": model_type, "builds": True, "rope": tiny.has_rope(model.config), "rope_type": rope_types(text),
            "layout": rotary_layout(model, text), "kinds": kinds, "hybrid": hybrid,
            "moe": any(name.endswith("experts") for name, _ in model.named_modules()),
            "mla": bool(text.get("kv_lora_rank")), "diff": max(diffs),
            "params": sum(p.numel() for p in model.parameters())}


def yes(flag) -> str:
    return {True: "yes", False: "no", None: "?"}[flag]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("types", nargs="*", help="model types (default: every causal-LM type)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: tiny models gain nothing from more, and on a "
                             "shared CPU extra threads wait on each other)")
    args = parser.parse_args(argv)
    types = args.types or tiny.causal_lm_types()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    models = {t: build(t) for t in types}  # the first build of a family also imports its modeling code
    build_seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    rows = [row(t, models[t]) for t in types]
    seconds = time.perf_counter() - t0
    table = []
    for r in rows:
        if r["builds"]:
            table.append([r["type"], "yes", yes(r["rope"]), r["rope_type"], r["layout"],
                          r["kinds"] + (" (hybrid)" if r["hybrid"] else ""), yes(r["moe"]), f"{r['diff']:.1e}"])
        else:
            table.append([r["type"], "no: " + r["reason"], yes(r["rope"]), "", "", "", "", ""])
    print(markdown_table(["model_type", "builds + generates", "RoPE", "rope type", "rotary layout",
                          "layer kinds (cache)", "MoE", "max abs(cached - uncached logits)"], table))
    built = [r for r in rows if r["builds"]]
    rope = [r for r in rows if r["rope"]]
    print()
    print(f"- model types: {len(rows)}; build, run a forward pass and a cached greedy generate: {len(built)}")
    print(f"- with RoPE (text config): {len(rope)}; of them build + generate: {sum(r['builds'] for r in rope)} "
          f"({100 * sum(r['builds'] for r in rope) / max(1, len(rope)):.1f} %)")
    print(f"- hybrid (attention + recurrent state): {sum(r['hybrid'] for r in built)}; MoE: "
          f"{sum(r['moe'] for r in built)}; MLA: {sum(r['mla'] for r in built)}")
    print(f"- largest tiny model: {max((r['params'] for r in built), default=0):,} parameters")
    print(f"- time, {args.threads} thread(s): build + one forward pass of all {len(types)} types "
          f"{build_seconds:.1f} s (modeling modules imported on the way); then generate, cache check and "
          f"layout probes {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
