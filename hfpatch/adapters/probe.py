"""One forward pass of a model on a few tokens, recording what every module was given and returned, and which
modules called transformers' attention interface (and with what).

This is how hfpatch reads a family's structure off the model instead of from a hand-written table: the attention
modules are the ones that call the attention interface (the interface passes `module` as its first argument), the
norms are the modules that compute a norm (checked numerically in `infer`), the block layout is what the recorded
tensors say flowed where. Nothing of the model is changed: hooks are removed and the attention implementation is put
back afterwards, whatever happens.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

if TYPE_CHECKING:
    from transformers import PreTrainedModel

PROBE_NAME = "hfpatch_probe"  # a neutral name: names with sdpa/flash/flex trigger transformers' capability checks
PROBE_TOKENS = 7


@dataclass
class Call:
    """One call of one module during the probe (the first call, for modules called several times)."""

    name: str  # path from the top model ("" is the model itself)
    order: int  # when the call started (pre-order: a block starts before its norms)
    end: int  # when it returned
    args: tuple  # the positional arguments as given (tensors detached)
    kwargs: dict
    input: torch.Tensor | None  # the first tensor argument (or hidden_states=), cloned when the call started
    output: torch.Tensor | None  # the first tensor of the output, cloned when the call returned
    calls: int = 1


@dataclass
class AttentionCall:
    name: str
    query: tuple  # shapes [batch, heads, q, head_dim]
    key: tuple
    kwargs: dict  # scaling, dropout, sliding_window, softcap, is_causal, ...


@dataclass
class Probe:
    ids: torch.Tensor
    calls: dict = field(default_factory=dict)  # name -> Call
    attention: dict = field(default_factory=dict)  # name -> AttentionCall
    interface: bool = False  # whether the forward could run with the attention interface recorded
    error: str | None = None  # why the forward failed (then calls/attention are partial)


def _first_tensor(args: tuple, kwargs: dict[str, Any]) -> torch.Tensor | None:
    if "hidden_states" in kwargs and isinstance(kwargs["hidden_states"], torch.Tensor):
        return kwargs["hidden_states"]
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    return None


def _out_tensor(out: Any):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    for key in ("last_hidden_state", "logits"):
        value = getattr(out, key, None)
        if isinstance(value, torch.Tensor):
            return value
    return None


def _clone(t: Any) -> Any:
    return None if t is None else t.detach().clone()


_CURRENT: list = []  # the probe being recorded (the registered function is global, the probe is not)


def _recording_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: Any,
                         attention_mask: torch.Tensor | None, **kwargs: Any) -> Any:
    probe, names, original = _CURRENT[-1]
    name = names.get(id(module), "?")
    if name not in probe.attention:
        probe.attention[name] = AttentionCall(name, tuple(query.shape), tuple(key.shape),
                                              {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)})
    return original(module)(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(PROBE_NAME, _recording_attention)


def _configs(model: PreTrainedModel) -> list:
    seen, out = set(), []
    for m in [model, *model.modules()]:
        c = getattr(m, "config", None)
        if c is not None and hasattr(c, "_attn_implementation_internal") and id(c) not in seen:
            seen.add(id(c))
            out.append(c)
    return out


@contextlib.contextmanager
def _recording_interface(model, probe, names):
    """Route every config's attention implementation through the recording function, which calls the original
    one (so the outputs are those of the unprobed model); the mask function is the original one's."""
    configs = _configs(model)
    before = [(c, c.__dict__.get("_attn_implementation_internal")) for c in configs]
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    mask = AttentionMaskInterface._global_mapping.get(impl, AttentionMaskInterface._global_mapping["eager"])
    AttentionMaskInterface.register(PROBE_NAME, mask)

    def original(module: nn.Module) -> Callable[..., Any]:
        if impl in ALL_ATTENTION_FUNCTIONS:
            return ALL_ATTENTION_FUNCTIONS[impl]
        eager = getattr(inspect.getmodule(type(module)), "eager_attention_forward", None)
        if eager is None:
            raise RuntimeError(f"no eager attention function next to {type(module).__name__}")
        return eager

    _CURRENT.append((probe, names, original))
    try:
        for c, _ in before:
            c._attn_implementation_internal = PROBE_NAME
        yield
    finally:
        _CURRENT.pop()
        for c, value in before:
            c._attn_implementation_internal = value


@torch.no_grad()
def run(model: Any, ids: torch.Tensor | None = None, record_interface: bool = True) -> Probe:
    """Probe `model` (a transformers PreTrainedModel) with one forward of `ids` (default: PROBE_TOKENS seeded
    random tokens)."""
    if ids is None:
        vocab = model.get_input_embeddings().num_embeddings
        g = torch.Generator().manual_seed(1234)
        ids = torch.randint(min(4, vocab - 1), vocab, (1, PROBE_TOKENS), generator=g)
    device = model.get_input_embeddings().weight.device
    if device.type == "meta":
        device = torch.device("cpu")
    probe = Probe(ids=ids)
    names = {id(m): n for n, m in model.named_modules()}
    counter = [0]
    started: dict = {}

    def pre(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        counter[0] += 1
        name = names[id(module)]
        if name in probe.calls:
            probe.calls[name].calls += 1
            return
        if name not in started:
            started[name] = (counter[0], _clone(_first_tensor(args, kwargs)))

    def post(module: nn.Module, args: tuple, kwargs: dict[str, Any], out: Any) -> None:
        counter[0] += 1
        name = names[id(module)]
        if name in probe.calls or name not in started:
            return
        order, inp = started.pop(name)
        probe.calls[name] = Call(name, order, counter[0], tuple(_detach(a) for a in args),
                                 {k: _detach(v) for k, v in kwargs.items()}, inp, _clone(_out_tensor(out)))

    handles = []
    modes = [(m, m.training) for m in model.modules()]  # restored one by one: submodules may differ (peft)
    try:
        for m in model.modules():
            handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(m.register_forward_hook(post, with_kwargs=True))
        model.eval()
        ctx = _recording_interface(model, probe, names) if record_interface else contextlib.nullcontext()
        with ctx:
            model(input_ids=ids.to(device), use_cache=False)
        probe.interface = record_interface and bool(probe.attention)
    except Exception as e:  # the reason goes into the adapter's notes
        probe.error = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    finally:
        for h in handles:
            h.remove()
        restore_modes(modes)
    return probe


def probe_logits(model: Any, patch: str, state: str) -> torch.Tensor:
    """The model's output on the probe's input (a few seeded random tokens), for the patches that check on it that
    they leave the model's function as it was where they should; `patch` ("position='self-extend'") and `state`
    name the check in the error when the forward fails."""
    probe = run(model, record_interface=False)
    if probe.error:
        raise ValueError(f"{patch} is checked on a probe forward, and the model {state} could not run it: "
                         f"{probe.error}")
    return probe.calls[""].output


def _rows_equal(t: Any) -> bool:
    if t is None or t.dim() < 2 or t.shape[-2] < 2:
        return True
    t = t.float()
    return bool(torch.allclose(t, t[..., :1, :].expand_as(t), rtol=1e-4, atol=1e-5 * max(1.0, float(t.abs().max()))))


def position_sources(model: Any, modules: list[str], stack: str) -> tuple[bool, list[str]]:
    """Where the model encodes position, found numerically (no class names, no config keys):
    - the embeddings, if on one token repeated the input rows of the stack's first block (`stack`.0) differ;
    - an attention module (or a block: the rest of a block works position by position), if its output at the last
      position changes when its earlier input rows are reversed (each row kept at its position index): attention
      without a position signal sees the same set of keys and values either way.
    Returns (embeddings encode position, the modules that do). `modules` are top-model paths."""
    vocab = model.get_input_embeddings().num_embeddings
    const = run(model, torch.full((1, PROBE_TOKENS), min(5, vocab - 1), dtype=torch.long), record_interface=False)
    probe = run(model, record_interface=False)
    if const.error or probe.error:
        raise RuntimeError(f"the position probe failed: {const.error or probe.error}")
    first = const.calls.get(f"{stack}.0")
    embedded = first is not None and not _rows_equal(first.input)
    sources = []
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        for name in modules:
            call = probe.calls.get(name)
            if call is None or call.input is None:
                continue
            args, kwargs = list(call.args), dict(call.kwargs)
            if "hidden_states" in kwargs:
                kwargs.pop("hidden_states")
            elif args:
                args.pop(0)
            x = call.input
            y = x.clone()
            y[:, :-1] = x[:, :-1].flip(1)
            module = model.get_submodule(name)
            with torch.no_grad():
                a, b = (_out_tensor(module(h, *args, **kwargs)) for h in (x, y))
            if not close(a[:, -1], b[:, -1]):
                sources.append(name)
    finally:
        restore_modes(modes)
    return embedded, sources


def close(a: Any, b: Any) -> bool:
    """Whether two outputs agree to float32 precision (2e-2 in half precision), relative to the first's scale."""
    rtol, atol = (1e-4, 1e-5) if a.dtype in (torch.float32, torch.float64) else (2e-2, 2e-2)
    return bool(torch.allclose(a.float(), b.float(), rtol=rtol, atol=atol * max(1.0, float(a.abs().max()))))


def restore_modes(modes: list[tuple[nn.Module, bool]]) -> None:
    for m, training in modes:
        m.training = training


def _detach(v: Any) -> Any:
    return v.detach() if isinstance(v, torch.Tensor) else v

