"""Read a family's structure off a live model (see `probe`): the blocks, each block's attention and MLP, its norms in
forward order and how they are placed, the residual stream's readers and writers, the rotary modules, a learned
position table. What cannot be read with certainty is left out and the reason goes into `Adapter.notes`, so the
patches that need it are refused with that reason instead of guessed.

Norms are recognised by what they compute, not by their class name: a module with at most a 1-D weight and bias,
called on one tensor, whose output equals RMSNorm or LayerNorm of its input with scale `weight` or `1 + weight` and
one of the eps values the module or config names (checked in float32 at two input scales, where eps matters and
where it does not).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D

from ..edits import Edits
from . import blocks
from . import probe as probes
from .base import Adapter, NormClass, class_key, get_path
from .positions import ZeroPositions, make_identity, trained_window

_EPS_ATTRS = ("eps", "variance_epsilon", "epsilon", "layer_norm_eps", "norm_eps")
_EPS_CONFIG = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps", "norm_epsilon")
_LINEARS = (nn.Linear, Conv1D)


class InferenceError(ValueError):
    """The model's structure could not be read (no blocks, no attention, ...): nothing can be patched."""


@dataclass
class _Info:
    model: PreTrainedModel
    probe: probes.Probe
    prefix: str  # name prefix of the base model inside the top model ("model." or "")

    def call(self, name):
        return self.probe.calls.get(name)

    def rel(self, name: str) -> str:
        return name[len(self.prefix):] if name.startswith(self.prefix) else name


# --------------------------------------------------------------------------------------------------------- norms


def _reference(kind: str, x: torch.Tensor, eps: float, scale, bias):
    h = x.double()
    if kind == "layernorm":
        h = h - h.mean(-1, keepdim=True)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if scale is not None:
        h = h * scale.double()
    if bias is not None:
        h = h + bias.double()
    return h


def classify_norm(module: nn.Module, config=None) -> NormClass | None:
    """What a norm-like module computes ("rmsnorm"/"layernorm", scale offset, eps), or None if it computes neither.
    Runs a float32 copy of the module on inputs of its own; the module itself is not touched."""
    if list(module.children()):
        return None
    params = dict(module.named_parameters(recurse=False))
    if set(params) - {"weight", "bias"} or any(p.dim() != 1 for p in params.values()):
        return None
    shapes = {p.shape[0] for p in params.values()}
    if len(shapes) > 1:
        return None
    dim = shapes.pop() if shapes else _norm_dim(module)
    if dim is None or dim < 2:
        return None
    candidates: list[tuple[str | None, float]] = []  # (the module's attribute that holds it, eps)
    for a in _EPS_ATTRS:
        v = getattr(module, a, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            candidates.append((a, float(v)))
    for a in _EPS_CONFIG:
        v = getattr(config, a, None) if config is not None else None
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            candidates.append((None, float(v)))
    candidates += [(None, e) for e in (1e-5, 1e-6, 1e-12, 1e-8)]
    try:
        twin = copy.deepcopy(module).float()
    except Exception:  # not copyable: not something we can swap either
        return None
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(3, dim, generator=g) * s + m for s, m in ((1.0, 0.3), (1e-3, 0.0))]
    try:
        with torch.no_grad():
            ys = [twin(x).double() for x in xs]
    except Exception:  # needs other inputs: not a plain norm
        return None
    if any(y.shape != x.shape for x, y in zip(xs, ys)):
        return None
    weight, bias = params.get("weight"), params.get("bias")
    for kind in ("rmsnorm", "layernorm"):
        for offset in ((0.0, 1.0) if weight is not None else (0.0,)):
            scale = None if weight is None else weight.detach().double().cpu() + offset
            b = None if bias is None else bias.detach().double().cpu()
            for attr, eps in candidates:
                if all(torch.allclose(y, _reference(kind, x, eps, scale, b), rtol=1e-4, atol=1e-5 * max(1.0, _mag(y)))
                       for x, y in zip(xs, ys)):
                    return NormClass(kind=kind, offset=offset, eps=eps, eps_attr=attr,
                                     upcast=_upcast(module, kind, eps, offset, xs[0]))
    return None


def _upcast(module, kind, eps, offset, x) -> str | None:
    """How the norm computes in bfloat16, read by running a bfloat16 copy: "fp32" (statistics and scale in float32,
    one rounding at the end: Gemma, hfpatch's own), "normalize" (statistics in float32, the scale applied in the
    input dtype: Llama), "none" (everything in bfloat16), or None if none matches bit for bit."""
    try:
        twin = copy.deepcopy(module).to(torch.bfloat16)
        with torch.no_grad():
            got = twin(x.to(torch.bfloat16))
    except Exception:  # no bfloat16 on this build: unknown
        return None
    w = getattr(twin, "weight", None)
    b = getattr(twin, "bias", None)

    def normed(h):
        if kind == "layernorm":
            h = h - h.mean(-1, keepdim=True)
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)

    def affine(h, dtype):
        h = h if w is None else h * (w.to(dtype) + offset)
        return h if b is None else h + b.to(dtype)

    xb = x.to(torch.bfloat16)
    forms = {"fp32": affine(normed(xb.float()), torch.float32).to(torch.bfloat16),
             "normalize": affine(normed(xb.float()).to(torch.bfloat16), torch.bfloat16),
             "none": affine(normed(xb), torch.bfloat16)}
    return next((name for name, ref in forms.items() if torch.equal(ref, got)), None)


def _mag(y):
    return float(y.abs().max())


def _norm_dim(module):
    shape = getattr(module, "normalized_shape", None)
    if isinstance(shape, (tuple, list, torch.Size)) and len(shape) == 1:
        return int(shape[0])
    if isinstance(shape, int):
        return shape
    return None


# ------------------------------------------------------------------------------------------------- block dataflow

_TOL = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-9, 1e-9)}


def _same(a, b) -> bool:
    if a is None or b is None or a.shape != b.shape:
        return False
    rtol, atol = _TOL.get(a.dtype, (2e-2, 2e-2))
    return bool(torch.allclose(a.float(), b.float(), rtol=rtol, atol=atol * max(1.0, float(b.abs().max()))))


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
    # Any: recorded tensors, None where a call recorded none (then _same() is False, and the sums are not reached
    # except where the patterns below evaluate one first)
    x: Any = block.input
    y: Any = block.output
    a: Any = attn.output
    m: Any = mlp.output
    n: list[tuple[Any, Any]] = [(c.input, c.output) for c in norms]
    if len(n) == 2:
        (i1, o1), (i2, o2) = n
        if _same(i1, x) and _same(attn.input, o1) and _same(i2, x + a) and _same(mlp.input, o2) and _same(y, x + a + m):
            return "pre"
        if _same(attn.input, x) and _same(i1, x + a) and _same(mlp.input, o1) and _same(i2, o1 + m) and _same(y, o2):
            return "post"
        if (_same(attn.input, x) and _same(i1, a) and _same(mlp.input, x + o1) and _same(i2, m)
                and _same(y, x + o1 + o2)):
            return "post_sublayer"
        if _same(i1, x) and _same(attn.input, o1) and _same(i2, x) and _same(mlp.input, o2) and _same(y, x + a + m):
            return "parallel2"
    if len(n) == 1:
        (i1, o1), = n
        if _same(i1, x) and _same(attn.input, o1) and _same(mlp.input, o1) and _same(y, x + a + m):
            return "parallel"
    if len(n) == 4:
        (i1, o1), (i2, o2), (i3, o3), (i4, o4) = n
        h = x + o2
        if _same(i1, x) and _same(attn.input, o1) and _same(i2, a) and _same(i3, h) and _same(mlp.input, o3) \
                and _same(i4, m) and _same(y, h + o4):
            return "sandwich"
    return None


# ---------------------------------------------------------------------------------------------------- inference


def _layer_index(name: str, layers: str) -> tuple[int, str] | None:
    m = re.match(re.escape(layers) + r"\.(\d+)(?:\.(.*))?$", name)
    return (int(m.group(1)), m.group(2) or "") if m else None


def _find_layers(info: _Info, attention_names: list[str]) -> str | None:
    """The ModuleList (top-model path) whose items hold all the attention modules (the outermost one: a block may
    keep its own attention modules in a list); without attention modules, the one ModuleList of
    config.num_hidden_layers items. None when neither is unique (e.g. two stacks of blocks)."""
    lists = {n for n, m in info.model.named_modules() if isinstance(m, nn.ModuleList)}
    if attention_names:
        for head in sorted(lists, key=lambda n: n.count(".")):
            if all(re.match(re.escape(head) + r"\.\d+\.", name) for name in attention_names):
                return head
        return None
    n = getattr(info.model.config.get_text_config(), "num_hidden_layers", None)
    sized = [name for name in lists
             if name.startswith(info.prefix) and len(cast(nn.ModuleList, info.model.get_submodule(name))) == n]
    return sized[0] if len(sized) == 1 else None


def infer(model, model_type: str | None = None) -> Adapter:
    """The Adapter of `model`, read off one probe forward: each step below reads one row of the table of what is
    read and how (README, "Adapters"). InferenceError if not even the blocks can be found."""
    config = model.config.get_text_config()
    model_type = model_type or config.model_type
    info = _probe(model)
    notes: dict[str, str] = {}  # what could not be read, by topic (the patches that need it are refused with it)
    attention_names = _attention_modules(info, notes)
    rotaries = _rotaries(info)
    stack = _blocks(info, attention_names, notes)
    if stack is None:
        return _without_blocks(model, rotaries, model_type, config)
    recognised, norm_classes = _norms(info, config, notes)
    norms, qk_norms = _block_norms(info, stack, recognised, notes)
    mlp = _mlp(info, stack, norms)
    layout, placement = _placement(info, stack, norms, mlp, notes)
    final_norm, embedding_norm, head_norms = _outer_norms(info, stack, recognised, notes)
    table, offset = _position_table(info, stack.top)
    placement_layout, dropouts = _block_forms(info, stack, layout, placement, norms, mlp, notes)
    notes.update(_position_notes(model, rotaries, table, mixer_paths(stack.top, stack.attention, stack.mixing),
                                 stack.top, bool(stack.attention and info.probe.interface)))
    readers, writers, embedding_writers, final_readers, why = _residual(
        info, stack.top, stack.mixing, stack.attention, mlp, norms, placement, final_norm)
    if why:
        notes["exact"] = why
    kinds = {c.kind for c in recognised.values()}
    offsets = {c.offset for c in recognised.values()}
    attn_module = model.get_submodule(f"{stack.ref}.{stack.attention}") if stack.attention else None
    return Adapter(
        model_type=model_type,
        layers=info.rel(stack.top),
        attention=stack.attention,
        attention_layers=stack.attention_layers if stack.hybrid else None,
        norms=tuple(norms),
        mlp=mlp,
        final_norm=final_norm,
        embedding_norm=embedding_norm,
        head_norms=head_norms,
        qk_norms=tuple(qk_norms),
        norm=kinds.pop() if len(kinds) == 1 else ("mixed" if kinds else "none"),
        norm_offset=offsets.pop() if len(offsets) == 1 else 0.0,
        norm_classes=norm_classes,
        placement=placement,
        parallel=layout in ("parallel", "parallel2"),
        placement_layout=placement_layout,
        residual_dropouts=dropouts,
        residual_readers=readers,
        residual_writers=writers,
        embedding_writers=embedding_writers,
        final_readers=final_readers,
        rotaries=rotaries,
        position_table=table,
        position_offset=offset,
        causal=bool(getattr(attn_module, "is_causal", True)) if attn_module is not None else True,
        attention_interface=info.probe.interface and stack.attention is not None,
        heads=tuple(info.probe.attention[f"{stack.top}.{i}.{stack.attention}"].query[1]
                    for i in stack.attention_layers) if stack.attention else (),
        window=trained_window(config),
        notes=notes,
    )


@dataclass
class _Stack:
    """The transformer blocks as the probe saw them."""

    top: str  # top-model path of the ModuleList
    blocks: list
    attention: str | None  # the attention module's path inside a block (None: not found)
    attention_layers: tuple  # the blocks that hold it (empty where it was not found)

    @property
    def mixing(self):
        """The blocks to read: those with the attention module, or all of them where none was found."""
        return self.attention_layers or range(len(self.blocks))

    @property
    def first(self) -> int:
        return next(iter(self.mixing), 0)

    @property
    def ref(self) -> str:
        """Top-model path of the first block read."""
        return f"{self.top}.{self.first}"

    @property
    def hybrid(self) -> bool:
        """Only some blocks have attention (the others another token mixer)."""
        return bool(self.attention_layers) and len(self.attention_layers) != len(self.blocks)


def _probe(model) -> _Info:
    """One probe forward; where the recording attention function breaks it, one without."""
    prefix = "" if model.base_model is model else model.base_model_prefix + "."
    probe = probes.run(model)
    if probe.error:  # the recording attention function broke the forward: read the structure without it
        plain = probes.run(model, probe.ids, record_interface=False)
        if plain.error:
            raise InferenceError(f"{type(model).__name__}: a forward pass on {probes.PROBE_TOKENS} tokens failed "
                                 f"({plain.error}), so hfpatch cannot read its structure")
        probe = plain
    return _Info(model, probe, prefix)


def _attention_modules(info: _Info, notes: dict) -> list[str]:
    """The modules that called transformers' attention interface, in call order."""
    probe = info.probe
    if not probe.interface:
        notes["attention"] = ("no module called transformers' attention interface (AttentionInterface); schemes "
                              "that replace the attention function (alibi) do not apply")
    return sorted(probe.attention, key=lambda n: probe.calls[n].order if n in probe.calls else 0)


def _blocks(info: _Info, attention_names: list[str], notes: dict) -> _Stack | None:
    """The blocks, and the attention module's path inside them where every attention block uses the same one; None
    where no list of blocks is found in the base model."""
    top = _find_layers(info, attention_names)
    if top is None or not top.startswith(info.prefix):
        return None
    per_block: dict[int, list[str]] = {}
    for name in attention_names:
        hit = _layer_index(name, top)
        if hit:
            per_block.setdefault(hit[0], []).append(hit[1])
    paths = {tuple(v) for v in per_block.values()}
    attention = None
    if len(paths) == 1 and len(next(iter(paths))) == 1:
        attention = next(iter(paths))[0]
    elif paths:
        notes["attention"] = f"blocks hold several attention modules or use different paths: {sorted(paths)}"
    if attention is None and not notes.get("attention"):
        notes["attention"] = "no attention module found in the blocks"
    return _Stack(top, list(cast(nn.ModuleList, info.model.get_submodule(top))), attention,
                  tuple(sorted(per_block)) if attention else ())


def _without_blocks(model, rotaries, model_type: str, config) -> Adapter:
    """Without a list of blocks, the rotary modules alone are enough to rescale RoPE; everything that needs the
    blocks is refused. InferenceError where there are none either."""
    if not rotaries:
        raise InferenceError(f"{type(model).__name__}: cannot find the list of transformer blocks "
                             "(a ModuleList holding the attention modules)")
    return Adapter(model_type=model_type, layers=None, attention=None, norms=(), placement=None, rotaries=rotaries,
                   attention_interface=False, window=trained_window(config),
                   notes={"blocks": "cannot find one list of transformer blocks holding all the attention modules "
                                    "(several stacks?): only RoPE rescaling applies"})


def _norms(info: _Info, config, notes: dict) -> tuple[dict, dict]:
    """({module path: NormClass} of every module the probe saw that computes RMSNorm / LayerNorm, {"module.Class":
    NormClass} of their classes)."""
    model, probe = info.model, info.probe
    norm_classes: dict[str, NormClass] = {}
    recognised: dict[str, NormClass] = {}
    for name, call in probe.calls.items():
        module = model.get_submodule(name)
        if call.input is None or not torch.is_floating_point(call.input) or list(module.children()) \
                or len(call.args) + len(call.kwargs) != 1:  # a norm takes one tensor (not a gated norm's two)
            continue
        cls = classify_norm(module, config)
        if cls is not None:
            recognised[name] = cls
            norm_classes.setdefault(class_key(module), cls)
    unrecognised = sorted(n for n, m in model.named_modules()
                          if "norm" in type(m).__name__.lower() and n not in recognised and n in probe.calls
                          and not list(m.children()))
    if unrecognised:
        notes["unrecognised_norms"] = (f"{len(unrecognised)} norm-like module(s) compute neither RMSNorm nor "
                                       f"LayerNorm and are left as they are by norm swaps, e.g. {unrecognised[0]} "
                                       f"({type(model.get_submodule(unrecognised[0])).__name__})")
    return recognised, norm_classes


def _block_norms(info: _Info, stack: _Stack, recognised: dict, notes: dict) -> tuple[list, list]:
    """(the block's own norms, its QK norms: those inside the attention module), block-relative, in forward order;
    the same in every block read, or a note says which differs."""
    def of(i):
        names = [n for n in recognised if n.startswith(f"{stack.top}.{i}.")]
        inner = f"{stack.top}.{i}.{stack.attention}." if stack.attention else None
        qk = [n for n in names if inner and n.startswith(inner)]
        own = [n for n in names if n not in qk]
        strip = len(f"{stack.top}.{i}.")
        return ([n[strip:] for n in sorted(own, key=_order(info))], [n[strip:] for n in sorted(qk, key=_order(info))])

    norms, qk_norms = of(stack.first)
    for i in stack.mixing:
        if of(i) != (norms, qk_norms):
            notes["norms"] = f"block {i} has other norms than block {stack.first}"
    return norms, qk_norms


def _order(info: _Info):
    return lambda name: info.probe.calls[name].order


def _mlp(info: _Info, stack: _Stack, norms: list) -> str | None:
    """The one called child of the block that is neither the attention nor a norm (None: not exactly one)."""
    kids = [n for n, c in stack.blocks[stack.first].named_children()
            if f"{stack.ref}.{n}" in info.probe.calls and any(True for _ in c.parameters())
            and n != (stack.attention or "").split(".")[0] and n not in norms]
    return kids[0] if len(kids) == 1 else None


def _placement(info: _Info, stack: _Stack, norms: list, mlp: str | None, notes: dict) -> tuple:
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


def _outer_norms(info: _Info, stack: _Stack, recognised: dict, notes: dict) -> tuple:
    """(final norm, embedding norm, task-head norms): recognised norms of the base model called after the last /
    before the first block, and those outside the base model."""
    probe, prefix = info.probe, info.prefix
    outside = [n for n in recognised if n.startswith(prefix) and not n.startswith(stack.top + ".")]
    called = [probe.calls[f"{stack.top}.{i}"] for i in range(len(stack.blocks)) if f"{stack.top}.{i}" in probe.calls]
    first_start, last_end = min(c.order for c in called), max(c.end for c in called)
    before = [n for n in outside if probe.calls[n].end < first_start]
    after = [n for n in outside if probe.calls[n].order > last_end]
    if len(after) > 1 or len(before) > 1:
        notes["norms"] = f"several norms outside the blocks: {sorted(map(info.rel, before + after))}"
    return (info.rel(after[-1]) if len(after) == 1 else None, info.rel(before[0]) if len(before) == 1 else None,
            tuple(n for n in recognised if prefix and not n.startswith(prefix)))


def _block_forms(info: _Info, stack: _Stack, layout, placement, norms: list, mlp: str | None, notes: dict) -> tuple:
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


def _residual_dropouts(info: _Info, ref: str, attention: str | None, mlp: str):
    """Dropout modules of the block applied to the attention / MLP output before the residual add (phi3's
    resid_attn_dropout, GPT-NeoX's post_attention_dropout): identity in eval mode, so found by their input."""
    out = []
    for sub in (attention, mlp):
        sub_call = info.call(f"{ref}.{sub}")
        hit = None
        for name, c in info.probe.calls.items():
            if name.startswith(ref + ".") and name.count(".") == ref.count(".") + 1 \
                    and isinstance(info.model.get_submodule(name), nn.Dropout) and c.order > sub_call.end \
                    and _same(c.input, sub_call.output):
                hit = name[len(ref) + 1:]
                break
        out.append(hit)
    return tuple(out)


def _verify_form(info: _Info, ref: str, spec: blocks.BlockSpec) -> str | None:
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
    if not _same(out, call.output):
        return (f"the block computes something besides the {spec.placement}-norm form (checked on a probe input), "
                "e.g. a residual scale or an extra sublayer")
    return None


def mixer_paths(layers_top: str, attention: str | None, indices) -> list[str]:
    """Top-model paths of the modules that mix positions: the attention modules, or the blocks where none was
    found."""
    return [f"{layers_top}.{i}.{attention}" if attention else f"{layers_top}.{i}" for i in indices]


def _position_notes(model, rotaries, table, mixers, layers_top, removable: bool) -> dict:
    """{"positions": why} when the model encodes position somewhere hfpatch did not find; {"removal": why} when
    taking out what it found leaves a position signal (checked only where `removable`: attention goes through the
    interface, which alibi / nope / sinusoidal need anyway); {} otherwise."""
    if rotaries or table:
        why = _removal_leaves(model, rotaries, table, mixers, layers_top) if removable else None
        return {"removal": why} if why else {}
    # nothing found: make sure there is nothing to find (a rotation computed inside attention, GPT-J style)
    try:
        embedded, sources = probes.position_sources(model, mixers, layers_top)
    except Exception as e:  # a test that cannot run says nothing: refuse, with the reason
        return {"positions": f"the position test could not run ({type(e).__name__}: {e})"}
    if embedded or sources:
        return {"positions": "the model encodes position (on a repeated token, " + (
            "its embeddings differ by position" if embedded else f"{sources[0]} makes positions differ") +
            ") but hfpatch found neither a rotary module (an inv_freq buffer) nor a learned position table"}
    return {}


def _removal_leaves(model, rotaries, table, attention, layers_top) -> str | None:
    """Whether taking out the position signal hfpatch found (rotaries -> identity, the table -> zeros) leaves none
    (what alibi / nope / sinusoidal rely on): tried on the model, checked numerically, undone. None, or what
    still tells positions apart."""
    edits = Edits()
    base = model.base_model
    try:
        for path in rotaries:
            rotary = get_path(base, path)
            make_identity(rotary, rotary.config, edits)
        if table:
            edits.mix_in(get_path(base, table), ZeroPositions, under=True)
        embedded, sources = probes.position_sources(model, attention, layers_top)
    except Exception as e:  # a test that cannot run says nothing: refuse, with the reason
        return f"the test that the position signal can be taken out could not run ({type(e).__name__}: {e})"
    finally:
        edits.undo()
    if embedded or sources:
        where = sources[0] if sources else "the embeddings"
        return (f"after its rotary modules / position table are taken out, {where} still tells positions apart "
                "(on a repeated token): the model has a position signal hfpatch cannot remove")
    return None


def _rotaries(info: _Info) -> tuple[str, ...]:
    """Base-relative paths of the rotary modules: modules of the base model with an inv_freq buffer (or one per
    layer type, "{type}_inv_freq"), called by the forward, whose output changes when those buffers do (some classes
    recompute their frequencies from the config at every call: rebuilding their buffers would do nothing). Rotary
    modules the short probe did not call (DeepSeek-V4's compressor rotaries, used on longer sequences) are included
    when they are of a verified class or read the same config object as a verified one."""
    out, verified, uncalled = [], set(), []
    for name, module in info.model.named_modules():
        keys = [b for b in module._buffers if b == "inv_freq" or (b.endswith("_inv_freq")
                                                                   and not b.endswith("original_inv_freq"))]
        call = info.call(name)
        if not keys or not name.startswith(info.prefix):
            continue
        if call is None:
            uncalled.append((name, module))
            continue
        saved = {k: module._buffers[k] for k in keys}
        # positions shifted by one: at position 0 every frequency rotates by nothing
        args = [a + 1 if _is_ids(a) else a for a in call.args]
        kwargs = {k: v + 1 if _is_ids(v) else v for k, v in call.kwargs.items()}
        try:
            with torch.no_grad():
                before = _flat(module(*args, **kwargs))
                for k in keys:
                    module._buffers[k] = saved[k] * 0.5 + 0.1
                after = _flat(module(*args, **kwargs))
        except Exception:  # not callable with its recorded inputs: not a module we can rebuild
            continue
        finally:
            module._buffers.update(saved)
        if before.numel() == 0:  # called on no positions at all (a compressor on a short sequence)
            uncalled.append((name, module))
        elif not torch.equal(before, after):
            out.append(info.rel(name))
            verified |= {type(module), id(getattr(module, "config", None))}
    out += [info.rel(name) for name, m in uncalled
            if type(m) in verified or (getattr(m, "config", None) is not None and id(m.config) in verified)]
    return tuple(sorted(out, key=lambda n: (n.count("."), n)))


def _is_ids(v) -> bool:
    return isinstance(v, torch.Tensor) and v.dtype in (torch.int64, torch.int32)


def _flat(out) -> torch.Tensor:
    parts = out if isinstance(out, (tuple, list)) else (out,)
    return torch.cat([p.detach().float().reshape(-1) for p in parts if isinstance(p, torch.Tensor)])


def _position_table(info: _Info, layers_top: str):
    """An nn.Embedding of the base model (not the token embedding) looked up with the position ids 0..T-1 (+ an
    offset): a learned absolute position table."""
    model = info.model
    tok = model.get_input_embeddings()
    t = info.probe.ids.shape[1]
    for name, call in info.probe.calls.items():
        m = model.get_submodule(name)
        if not isinstance(m, nn.Embedding) or m is tok or not name.startswith(info.prefix) \
                or name.startswith(layers_top + "."):
            continue
        ids = call.args[0] if call.args and isinstance(call.args[0], torch.Tensor) else None
        if ids is None or ids.dtype not in (torch.int64, torch.int32) or ids.shape[-1] != t:
            continue
        k = int(ids.reshape(-1, t)[0, 0])
        if torch.equal(ids.reshape(-1, t)[0].cpu(), torch.arange(k, k + t)):
            return info.rel(name), k
    return None, 0


def _is_linear(module) -> bool:
    """nn.Linear, GPT-2's Conv1D, or a peft tuner layer around one (the exact conversion then refuses with what
    to do, instead of folding into the wrapped base layer while the adapter keeps reading the norm's output)."""
    return isinstance(module, _LINEARS) or hasattr(module, "base_layer")


def _linear_calls(info: _Info, within: str):
    return [(n, c) for n, c in info.probe.calls.items()
            if n.startswith(within) and _is_linear(info.model.get_submodule(n)) and ".base_layer" not in n]


def _residual(info: _Info, layers_top, indices, attention, mlp, norms, placement, final_norm):
    """The residual stream's readers (linears fed by each block norm), writers (linears whose output is added to the
    stream), embedding writers (what starts the stream) and what reads the final norm: what the exact
    LayerNorm -> RMSNorm conversion folds into. ((), ..., reason) when they cannot all be identified, or when the
    blocks differ (a dense block then mixture-of-experts blocks)."""
    if placement != "pre":
        return {}, (), (), (), ("the block norms are not all pre-norms of the residual stream "
                                f"(layout {placement or 'unknown'})")
    if not mlp:
        return {}, (), (), (), "the block has no single MLP module whose output the probe can follow"
    found = [_block_residual(info, f"{layers_top}.{i}.", attention, mlp, norms) for i in indices]
    if any(isinstance(f, str) for f in found):
        return {}, (), (), (), next(f for f in found if isinstance(f, str))
    if any(f != found[0] for f in found):
        return {}, (), (), (), "the blocks read and write the residual stream through different linear layers"
    readers, writers = found[0]
    embedding = _stream_start(info, layers_top)
    if not embedding:
        return {}, (), (), (), ("cannot account for the residual stream's start (embeddings) as the sum of module "
                                "outputs")
    return readers, writers, embedding, _final_readers(info, final_norm), None


def _block_residual(info: _Info, block: str, attention, mlp, norms):
    """(readers, writers) of one block, or why they cannot be identified."""
    calls = _linear_calls(info, block)
    readers = {}
    for n in norms:
        out = info.call(block + n).output
        found = tuple(name[len(block):] for name, c in calls if _same(c.input, out))
        if not found:
            return f"cannot find the linear layers that read {n}"
        readers[n] = found
    outs = [info.call(block + attention).output, info.call(block + mlp).output]
    writers = []
    for o in outs:
        hit = [name[len(block):] for name, c in calls if _same(c.output, o)]
        if len(hit) != 1:
            return ("a sublayer's output is not the output of one linear layer (e.g. a mixture of experts), so the "
                    "residual stream's writers cannot be centred")
        writers.append(hit[0])
    return readers, tuple(writers)


def _stream_start(info: _Info, layers_top: str):
    """One or two modules before the first block whose outputs (times a constant) sum to its input."""
    x0 = info.call(f"{layers_top}.0").input
    first = info.call(f"{layers_top}.0").order
    cands = [(n, c) for n, c in info.probe.calls.items()
             if n.startswith(info.prefix) and c.end < first and c.output is not None and c.output.shape == x0.shape
             and isinstance(info.model.get_submodule(n), (nn.Embedding, *_LINEARS))]
    embedding = None
    for size in (1, 2):
        for combo in _combos(cands, size):
            s = sum(c.output.double() for _, c in combo)
            alpha = float((s * x0.double()).sum() / (s * s).sum().clamp(min=1e-30))
            if _same((alpha * s).to(x0.dtype), x0):
                embedding = tuple(info.rel(n) for n, _ in combo)
                break
        if embedding:
            break
    return embedding


def _final_readers(info: _Info, final_norm):
    """What reads the final norm if not the LM head (OPT's project_out)."""
    final_readers: tuple[str, ...] = ()
    if final_norm:
        out = info.call(info.prefix + final_norm).output
        head = info.model.get_output_embeddings()
        readers_f = [n for n, c in info.probe.calls.items() if c.input is not None and _same(c.input, out)
                     and _is_linear(info.model.get_submodule(n)) and ".base_layer" not in n]
        others = [n for n in readers_f if info.model.get_submodule(n) is not head]
        if others:
            final_readers = tuple(info.rel(n) for n in others)
    return final_readers


def _combos(items, size):
    if size == 1:
        return [[x] for x in items]
    return [[a, b] for k, a in enumerate(items) for b in items[k + 1:]]
