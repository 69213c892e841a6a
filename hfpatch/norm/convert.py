"""norm=...: swap every norm of the model for the kind a record of norm/kinds.NORMS describes, exactly where the
math allows it (the exact LayerNorm -> RMSNorm conversion below; BatchNorm: never, its statistics come from the
batch, norm/batchnorm.py says how it learns what is padding).

Every change goes through `Edits`, so a failure half-way is undone and `unpatch` restores the original modules and
parameters themselves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from ..adapters import Adapter, get_path
from ..adapters.base import class_key
from ..adapters.probe import restore_modes
from ..edits import Edits
from ..utils.warn import NeedsCalibrationWarning, warn_caller
from . import exact as ex
from .modules import NormModule, NormParams, RMSNorm, build, read

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def _parent(root: nn.Module, path: str) -> tuple[nn.Module, str]:
    head, _, name = path.rpartition(".")
    return (get_path(root, head) if head else root), name


def norm_sites(model: PreTrainedModel, adapter: Adapter) -> list[tuple[str, nn.Module]]:
    """(path from `model`, module) of every norm: per block, QK norms, the embedding and final norms, task heads.
    Only modules that compute a recognised norm (a hybrid block may hold a gated norm under the same name)."""
    if adapter.layers is None:
        return []
    base = model.base_model
    prefix = "" if base is model else model.base_model_prefix + "."
    paths = []
    for i in range(len(get_path(base, adapter.layers))):
        paths += [f"{prefix}{adapter.layers}.{i}.{n}" for n in adapter.norms + adapter.qk_norms]
    paths += [prefix + p for p in (adapter.embedding_norm, adapter.final_norm) if p]
    paths += [p for p in adapter.head_norms if _find(model, p) is not None]
    sites = [(p, _find(model, p)) for p in paths]
    return [(p, m) for p, m in sites if m is not None and recognised(m, adapter)]  # OPT without a final norm


def recognised(module: nn.Module, adapter: Adapter) -> bool:
    return isinstance(module, (NormModule, nn.LayerNorm)) or class_key(module) in adapter.norm_classes


def current_kind(model: PreTrainedModel, adapter: Adapter) -> str:
    kinds = {read(m, adapter.norm_classes).kind for _, m in norm_sites(model, adapter)}
    return kinds.pop() if len(kinds) == 1 else ("mixed" if kinds else "none")


def exact_blocker(model: PreTrainedModel, adapter: Adapter, placement: str | None) -> str | None:
    """Why LayerNorm -> RMSNorm cannot be function-preserving on this model (None: it can)."""
    if placement is None:
        return adapter.notes.get("exact") or adapter.notes.get("placement") or "the block layout is unknown"
    if placement != "pre":
        return {
            "post": "norms after the residual add (post-norm) see the raw stream, whose mean cannot be removed",
            "sandwich": "the post-sublayer norms write their output into the residual stream, which cannot be centred",
            "post_sublayer": "the norms after each sublayer write into the residual stream, which cannot be centred",
        }.get(placement, f"placement {placement!r}")
    if not adapter.residual_readers:
        return adapter.notes.get("exact") or f"no residual-stream description for {adapter.model_type}"
    return None


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warn_caller(message)


def apply_norm(model: PreTrainedModel, adapter: Adapter, req: dict, norm: Any, placement: str | None,
               edits: Edits) -> dict:
    """Swap the norms for the kind `req` asks for (`norm`: its record in norm/kinds.NORMS, whose requirements the
    caller checked); returns facts for describe(): {"exact": bool, "reason": str (when not exact)}."""
    kind, want_exact = req["kind"], req.get("exact", True)
    sites = [(p, m) for p, m in norm_sites(model, adapter) if read(m, adapter.norm_classes).kind != kind]
    if not sites:
        return {"exact": True}
    if norm.exact is None:
        reason = norm.inexact
    elif not want_exact:
        reason = "exact=False was asked for"
    else:
        reason = norm.exact(model, adapter, placement, edits)
        if reason is None:
            return {"exact": True}
    if want_exact:
        _warn_once(f"hfpatch: norm={kind!r} on {adapter.model_type} is a plain swap, not function-preserving: {reason}")
    attributes = norm.prepare(model, edits) if norm.prepare is not None else {}
    for path, module in sites:
        _plain_swap(model, path, module, norm, adapter, edits, attributes)
    problem = None if norm.check is None or _on_meta(model) else norm.check(model)
    if problem:
        warn_caller(f"hfpatch: {problem}", NeedsCalibrationWarning)
    return {"exact": False, "reason": reason}


def _on_meta(model: PreTrainedModel) -> bool:
    """Built without weights (transformers builds on the meta device while a saved patch is reloaded)."""
    return any(p.device.type == "meta" for p in model.parameters())


def _plain_swap(model, path, module, norm, adapter, edits, attributes):
    """Same weight (and offset), same eps: LayerNorm -> RMSNorm keeps β as a bias; a kind whose form always has a
    bias (`norm.bias`: LayerNorm, BatchNorm) gets a zero one where the replaced norm had none. A norm without
    parameters stays without them. The new module takes the old one's train/eval mode and `attributes` (what
    `norm.prepare` returned: a BatchNorm's padding)."""
    p = read(module, adapter.norm_classes)
    affine = p.weight is not None
    bias = p.bias if not norm.bias or not affine else (p.bias if p.bias is not None else torch.zeros_like(p.weight))
    like = p.weight if affine else (p.bias if p.bias is not None else next(model.parameters()))
    shape = p.weight.shape if affine else tuple(getattr(module, "normalized_shape", None) or
                                                (getattr(module, "hidden_size", None) or module.dim,))
    new = build(norm.module, shape, p.eps, p.offset, p.weight, bias, like).train(module.training)
    keep_trainable(new, p)
    new.replaced = p.kind  # what a calibration fits the new norm to (norm/fit.py)
    for name, value in attributes.items():
        setattr(new, name, value)
    parent, name = _parent(model, path)
    edits.set(parent, name, new)


# ------------------------------------------------------------------------------------------------- exact conversion


def _linear(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """(weight, bias, conv1d?) of nn.Linear or GPT-2's Conv1D."""
    if isinstance(module, Conv1D):
        return module.weight, module.bias, True
    if isinstance(module, nn.Linear):
        return module.weight, module.bias, False
    if hasattr(module, "base_layer"):  # a peft tuner layer (LoRA, ...) around the linear layer
        raise ValueError(
            f"the exact norm conversion folds weights into linear layers, but this one is wrapped by peft "
            f"({type(module).__module__}.{type(module).__name__}); patch the norms before adding adapters, merge "
            "them first (merge_and_unload), or use exact=False for a plain swap"
        )
    raise ValueError(f"the exact norm conversion folds weights into linear layers; got {type(module).__name__}")


def keep_trainable(new: nn.Module, old: NormParams) -> None:
    """The new norm's parameters are trainable exactly where the ones they replace were: a frozen model stays
    frozen and a LoRA model keeps its set of trainable tensors. A bias the old norm did not have follows its weight.
    (A parameter a swap creates would otherwise be trainable, as every new nn.Parameter is.)"""
    weight = old.weight if old.weight is not None else old.bias
    for name, was in (("weight", weight), ("bias", old.bias if old.bias is not None else weight)):
        param = getattr(new, name, None)
        if isinstance(param, nn.Parameter) and was is not None:
            param.requires_grad_(was.requires_grad)
    for name, param in new.named_parameters(recurse=False):  # a kind's own parameters (DyT's α) follow the weight
        if name not in ("weight", "bias") and weight is not None:
            param.requires_grad_(weight.requires_grad)


def _param(t: torch.Tensor, like: nn.Parameter | None) -> nn.Parameter:
    """A converted parameter, trainable if the one it replaces (`like`) was; a new one (None) is trainable."""
    return nn.Parameter(t, requires_grad=True if like is None else like.requires_grad)


def _find(base: nn.Module, path: str) -> nn.Module | None:
    """The module at `path` ("a|b": the first alternative the model has and that is not None), or None."""
    for alt in path.split("|"):
        try:
            m = get_path(base, alt)
        except AttributeError:
            continue
        if m is not None:
            return m
    return None


def _centre_writer(m, edits):
    if isinstance(m, nn.Embedding):
        edits.set(m, "weight", _param(ex.centre_rows(m.weight), m.weight))
        return
    w, b, conv = _linear(m)
    w2, b2 = ex.centre_output(w, b, conv)
    edits.set(m, "weight", _param(w2, m.weight))
    if b is not None:
        edits.set(m, "bias", _param(b2, m.bias))


def exact_rmsnorm(model: PreTrainedModel, adapter: Adapter, placement: str, edits: Edits) -> str | None:
    """The function-preserving LayerNorm -> RMSNorm conversion (norm/exact.py), made through `edits` where the model
    allows it and its logits confirm it: None, or why not (and nothing is changed)."""
    return exact_blocker(model, adapter, placement) or _exact_verified(model, adapter, edits)


@torch.no_grad()
def _exact_verified(model: PreTrainedModel, adapter: Adapter, edits: Edits) -> str | None:
    """The exact conversion, kept only if the model's logits on a probe input stay what they were (the residual
    stream's readers and writers were read off the model: this checks the reading). None, or why it was undone.
    A model without weights yet (built on the meta device while a saved conversion is reloaded) is converted
    unchecked: the check was made when the conversion was saved."""
    if _on_meta(model):
        _exact_to_rmsnorm(model, adapter, edits)
        return None
    ids, modes = _probe_ids(model), [(m, m.training) for m in model.modules()]
    model.eval()
    trial = Edits()
    try:
        before = _output(model(input_ids=ids, use_cache=False))
        _exact_to_rmsnorm(model, adapter, trial)
        after = _output(model(input_ids=ids, use_cache=False))
    except BaseException:
        trial.undo()
        raise
    finally:
        restore_modes(modes)
    diff = float((after - before).abs().max())
    tol = (1e-3 if next(model.parameters()).dtype == torch.float32 else 5e-2) * max(1.0, float(before.abs().max()))
    if diff > tol:
        trial.undo()
        return (f"the exact conversion did not reproduce the model's logits on a probe input (max diff {diff:.3g}): "
                "something besides the identified linear layers reads or writes the residual stream")
    edits.absorb(trial)
    return None


def _output(out: Any) -> torch.Tensor:
    return (out.logits if getattr(out, "logits", None) is not None else out[0]).double()


def _probe_ids(model: Any) -> torch.Tensor:
    vocab = model.get_input_embeddings().num_embeddings
    g = torch.Generator().manual_seed(4321)
    device = model.get_input_embeddings().weight.device
    return torch.randint(min(4, vocab - 1), vocab, (1, 7), generator=g).to(device if device.type != "meta" else "cpu")


@torch.no_grad()
def _exact_to_rmsnorm(model: Any, adapter: Adapter, edits: Edits) -> None:
    base = model.base_model
    head = model.get_output_embeddings() if model is not base else None
    tied = head is not None and head.weight is base.get_input_embeddings().weight
    # 1. centre everything that writes to the residual stream
    for path in adapter.embedding_writers:
        _centre_writer(_find(base, path), edits)
    layers = get_path(base, adapter.layers)
    for layer in layers:
        for path in adapter.residual_writers:
            _centre_writer(get_path(layer, path), edits)
    # 2. fold each block norm's affine into its readers; the norm becomes a unit RMSNorm
    for i, layer in enumerate(layers):
        for norm_name, readers in adapter.residual_readers.items():
            _fold_norm(model, f"{adapter.layers}.{i}.{norm_name}", [get_path(layer, r) for r in readers], adapter,
                       edits)
    # 3. the final norm folds into what reads it: OPT's project_out, else the LM head
    if adapter.final_norm and get_path(base, adapter.final_norm) is not None:
        reader = next((m for m in (_find(base, p) for p in adapter.final_readers) if m is not None), head)
        _fold_norm(model, adapter.final_norm, [reader] if reader is not None else [], adapter, edits)
    # The head kept the original embedding matrix (times γ) while the input embedding was centred: untie them for
    # good, or transformers would tie them again on save/reload.
    if tied and head is not None and head.weight is not base.get_input_embeddings().weight:  # (tied: head exists)
        edits.set(model.config, "tie_word_embeddings", False)


def _fold_norm(model, path, readers, adapter, edits):
    norm = get_path(model.base_model, path)
    p = read(norm, adapter.norm_classes)
    gamma, beta = p.scale(), p.bias
    like = readers[0].weight if readers else (p.weight if p.weight is not None else p.bias)
    shape = tuple(getattr(norm, "normalized_shape", None) or p.weight.shape)
    if readers:
        for r in readers:
            w, b, conv = _linear(r)
            w2, b2 = ex.fold_affine(w, b, gamma, beta, conv)
            edits.set(r, "weight", _param(w2, r.weight))
            # a reader without a bias gets one (it carries β): trainable as the reader's weight is
            edits.set(r, "bias", _param(b2, r.bias if r.bias is not None else r.weight))
        unit = None if p.weight is None else torch.ones(shape)
        new = build(RMSNorm, shape, p.eps, 0.0, unit, None, like)
    else:  # nothing to fold into (a bare base model): the RMSNorm keeps γ and β, exact on the centred stream
        new = build(RMSNorm, shape, p.eps, 0.0, gamma, beta, like)
    keep_trainable(new, p)
    parent, name = _parent(model.base_model, path)
    edits.set(parent, name, new)
