"""How a block is laid out, read from the dataflow of one recorded forward: the MLP, whether the norms sit
before or after their sublayer (or the block is parallel), and whether hfpatch's own block forms reproduce it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import blocks
from .. import probe as probes
from .reading import Info, Stack, same


def _layout(block: probes.Call, norms: list, attn: probes.Call | None, mlp: probes.Call | None) -> str | None:
    """Which known block layout the recorded tensors follow (None: none of them). x is the block input, y its
    output, A/M the attention/MLP calls, N1.. the block norms in call order.

        pre            N1(x) -> A;  h = x + A;  N2(h) -> M;  y = h + M
        post           A(x);  h = N1(x + A);  M(h);  y = N2(h + M)
        post_sublayer  A(x);  h = x + N1(A);  M(h);  y = h + N2(M)            (OLMo2)
        sandwich       N1(x) -> A;  h = x + N2(A);  N3(h) -> M;  y = h + N4(M)  (Gemma2/3)
        parallel       N1(x) -> A and M;  y = x + A + M                       (GPT-J, Phi-1/2, Cohere)
        parallel2      N1(x) -> A;  N2(x) -> M;  y = x + A + M                (GPT-NeoX)
    """
    if mlp is None or attn is None:
        return None
    # Any: recorded tensors, None where a call recorded none (then same() is False, and the sums are not reached
    # except where the patterns below evaluate one first)
    x: Any = block.input
    y: Any = block.output
    a: Any = attn.output
    m: Any = mlp.output
    n: list[tuple[Any, Any]] = [(c.input, c.output) for c in norms]
    if len(n) == 2:
        (i1, o1), (i2, o2) = n
        if same(i1, x) and same(attn.input, o1) and same(i2, x + a) and same(mlp.input, o2) and same(y, x + a + m):
            return "pre"
        if same(attn.input, x) and same(i1, x + a) and same(mlp.input, o1) and same(i2, o1 + m) and same(y, o2):
            return "post"
        if (same(attn.input, x) and same(i1, a) and same(mlp.input, x + o1) and same(i2, m)
                and same(y, x + o1 + o2)):
            return "post_sublayer"
        if same(i1, x) and same(attn.input, o1) and same(i2, x) and same(mlp.input, o2) and same(y, x + a + m):
            return "parallel2"
    if len(n) == 1:
        (i1, o1), = n
        if same(i1, x) and same(attn.input, o1) and same(mlp.input, o1) and same(y, x + a + m):
            return "parallel"
    if len(n) == 4:
        (i1, o1), (i2, o2), (i3, o3), (i4, o4) = n
        h = x + o2
        if same(i1, x) and same(attn.input, o1) and same(i2, a) and same(i3, h) and same(mlp.input, o3) \
                and same(i4, m) and same(y, h + o4):
            return "sandwich"
    return None


def read_mlp(info: Info, stack: Stack, norms: list) -> str | None:
    """The one called child of the block that is neither the attention nor a norm (None: not exactly one)."""
    kids = [n for n, c in stack.blocks[stack.first].named_children()
            if f"{stack.ref}.{n}" in info.probe.calls and any(True for _ in c.parameters())
            and n != (stack.attention or "").split(".")[0] and n not in norms]
    return kids[0] if len(kids) == 1 else None


def read_placement(info: Info, stack: Stack, norms: list, mlp: str | None, notes: dict) -> tuple:
    """(the layout every block's recorded dataflow follows, the placement it amounts to), None where unknown."""
    layouts = set()
    for i in stack.mixing:
        block = info.call(f"{stack.top}.{i}")
        norm_calls = [info.call(f"{stack.top}.{i}.{n}") for n in norms]
        attn = info.call(f"{stack.top}.{i}.{stack.attention}") if stack.attention else None
        ffn = info.call(f"{stack.top}.{i}.{mlp}") if mlp else None
        layouts.add(_layout(block, norm_calls, attn, ffn) if block and None not in norm_calls else None)
    layout = layouts.pop() if len(layouts) == 1 else None
    placement = "pre" if layout in ("parallel", "parallel2") else layout
    if stack.hybrid:
        placement = None
        notes["placement"] = (f"hybrid stack: {len(stack.attention_layers)} of {len(stack.blocks)} blocks have "
                              "attention, the others another token mixer")
    elif placement is None:
        notes["placement"] = ("the block's dataflow matches no known layout (pre, post, post_sublayer, sandwich, "
                              "parallel): a residual scale, an extra sublayer or several MLP-like modules")
    return layout, placement


def read_block_forms(info: Info, stack: Stack, layout: Any, placement: str | None, norms: list, mlp: str | None,
                     notes: dict) -> tuple:
    """("generic" where the pre/post block forms (adapters/blocks.py) reproduce the block, else None; the residual
    dropouts they apply)."""
    if placement not in ("pre", "post") or "placement" in notes:
        return None, (None, None)
    if len(norms) != 2 or not mlp:
        notes["placement"] = (f"blocks with {len(norms)} norm(s) and {'an' if mlp else 'no'} MLP module: no known "
                              "pre/post form")
        return None, (None, None)
    dropouts = _residual_dropouts(info, stack.ref, stack.attention, mlp)
    spec = blocks.BlockSpec("parallel" if layout in ("parallel", "parallel2") else placement, stack.attention, mlp,
                            tuple(norms), dropouts)
    why = _verify_form(info, stack.ref, spec)
    if why:
        notes["placement"] = why
        return None, dropouts
    return "generic", dropouts


def _residual_dropouts(info: Info, ref: str, attention: str | None, mlp: str):
    """Dropout modules of the block applied to the attention / MLP output before the residual add (phi3's
    resid_attn_dropout, GPT-NeoX's post_attention_dropout): identity in eval mode, so found by their input."""
    out = []
    for sub in (attention, mlp):
        sub_call = info.call(f"{ref}.{sub}")
        hit = None
        for name, c in info.probe.calls.items():
            if name.startswith(ref + ".") and name.count(".") == ref.count(".") + 1 \
                    and isinstance(info.model.get_submodule(name), nn.Dropout) and c.order > sub_call.end \
                    and same(c.input, sub_call.output):
                hit = name[len(ref) + 1:]
                break
        out.append(hit)
    return tuple(out)


def _verify_form(info: Info, ref: str, spec: blocks.BlockSpec) -> str | None:
    """Run the generic form of the block's own placement on the probe's recorded inputs: None if it reproduces the
    block's output, else why the generic forms do not apply."""
    block = info.model.get_submodule(ref)
    call = info.call(ref)
    args, kwargs = list(call.args), dict(call.kwargs)
    if "hidden_states" in kwargs:
        kwargs.pop("hidden_states")
    elif args:
        args.pop(0)
    try:
        with torch.no_grad():
            out = blocks.run(block, spec, block.forward, call.input, tuple(args), kwargs)
    except Exception as e:  # the reason is the answer
        return f"the generic {spec.placement} block form failed on this block ({type(e).__name__}: {e})"
    out = out[0] if isinstance(out, tuple) else out
    if not same(out, call.output):
        return (f"the block computes something besides the {spec.placement}-norm form (checked on a probe input), "
                "e.g. a residual scale or an extra sublayer")
    return None

