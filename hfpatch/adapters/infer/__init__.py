"""Read a family's structure off a live model (see `adapters.probe`): the blocks, each block's attention and MLP,
its norms in forward order and how they are placed, the residual stream's readers and writers, the rotary modules,
a learned position table. What cannot be read with certainty is left out and the reason goes into `Adapter.notes`,
so the patches that need it are refused with that reason instead of guessed.

`infer()` reads the blocks here and hands each topic to its own module: `norms` (which modules are norms, by what
they compute), `placement` (pre/post/parallel, from the dataflow of one block), `positions` (rotary modules, a
learned table, whether removing them leaves the model position-blind) and `residual` (who reads and writes the
residual stream, for the exact norm conversion). `reading` holds what they share: the probe's record and the
blocks as the probe saw them.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, cast

from torch import nn

from .. import probe as probes
from ..base import Adapter
from ..positions import trained_window
from .norms import classify_norm, read_block_norms, read_norms, read_outer_norms
from .placement import read_block_forms, read_mlp, read_placement
from .positions import mixer_paths, read_position_notes, read_position_table, read_rotaries
from .reading import InferenceError, Info, Stack, layer_index
from .residual import read_residual

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedModel


def _find_layers(info: Info, attention_names: list[str]) -> str | None:
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


def infer(model: PreTrainedModel, model_type: str | None = None) -> Adapter:
    """The Adapter of `model`, read off one probe forward: each step below reads one row of the table of what is
    read and how (README, "Adapters"). InferenceError if not even the blocks can be found."""
    config = model.config.get_text_config()
    model_type = model_type or config.model_type
    info = _probe(model)
    notes: dict[str, str] = {}  # what could not be read, by topic (the patches that need it are refused with it)
    attention_names = _attention_modules(info, notes)
    rotaries = read_rotaries(info)
    stack = _blocks(info, attention_names, notes)
    if stack is None:
        return _without_blocks(model, rotaries, model_type, config)
    recognised, norm_classes = read_norms(info, config, notes)
    norms, qk_norms = read_block_norms(info, stack, recognised, notes)
    mlp = read_mlp(info, stack, norms)
    layout, placement = read_placement(info, stack, norms, mlp, notes)
    final_norm, embedding_norm, head_norms = read_outer_norms(info, stack, recognised, notes)
    table, offset = read_position_table(info, stack.top)
    placement_layout, dropouts = read_block_forms(info, stack, layout, placement, norms, mlp, notes)
    notes.update(read_position_notes(model, rotaries, table, mixer_paths(stack.top, stack.attention, stack.mixing),
                                 stack.top, bool(stack.attention and info.probe.interface)))
    readers, writers, embedding_writers, final_readers, why = read_residual(
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


def _probe(model: PreTrainedModel) -> Info:
    """One probe forward; where the recording attention function breaks it, one without."""
    prefix = "" if model.base_model is model else model.base_model_prefix + "."
    probe = probes.run(model)
    if probe.error:  # the recording attention function broke the forward: read the structure without it
        plain = probes.run(model, probe.ids, record_interface=False)
        if plain.error:
            raise InferenceError(f"{type(model).__name__}: a forward pass on {probes.PROBE_TOKENS} tokens failed "
                                 f"({plain.error}), so hfpatch cannot read its structure")
        probe = plain
    return Info(model, probe, prefix)


def _attention_modules(info: Info, notes: dict) -> list[str]:
    """The modules that called transformers' attention interface, in call order."""
    probe = info.probe
    if not probe.interface:
        notes["attention"] = ("no module called transformers' attention interface (AttentionInterface); schemes "
                              "that replace the attention function (alibi) do not apply")
    return sorted(probe.attention, key=lambda n: probe.calls[n].order if n in probe.calls else 0)


def _blocks(info: Info, attention_names: list[str], notes: dict) -> Stack | None:
    """The blocks, and the attention module's path inside them where every attention block uses the same one; None
    where no list of blocks is found in the base model."""
    top = _find_layers(info, attention_names)
    if top is None or not top.startswith(info.prefix):
        return None
    per_block: dict[int, list[str]] = {}
    for name in attention_names:
        hit = layer_index(name, top)
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
    return Stack(top, list(cast(nn.ModuleList, info.model.get_submodule(top))), attention,
                  tuple(sorted(per_block)) if attention else ())


def _without_blocks(model: PreTrainedModel, rotaries: tuple[str, ...], model_type: str,
                    config: PreTrainedConfig) -> Adapter:
    """Without a list of blocks, the rotary modules alone are enough to rescale RoPE; everything that needs the
    blocks is refused. InferenceError where there are none either."""
    if not rotaries:
        raise InferenceError(f"{type(model).__name__}: cannot find the list of transformer blocks "
                             "(a ModuleList holding the attention modules)")
    return Adapter(model_type=model_type, layers=None, attention=None, norms=(), placement=None, rotaries=rotaries,
                   attention_interface=False, window=trained_window(config),
                   notes={"blocks": "cannot find one list of transformer blocks holding all the attention modules "
                                    "(several stacks?): only RoPE rescaling applies"})


__all__ = ["InferenceError", "classify_norm", "infer", "mixer_paths"]
