"""position=...: RoPE scaling (rescale the live rotary module), no position signal (nope), the sinusoidal table, and
interpolate (stretch a learned table). Every change goes through `Edits`."""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any, cast

import torch
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel

from ..adapters import Adapter, get_path
from ..adapters.positions import layer_types, params_of, prefix, trained_window
from ..edits import Edits
from .rope import builders as rope
from .rope import rotary as rot
from .rope.rotary import rotaries_of
from .schemes import absolute
from .schemes.removal import remove_positions


def max_positions(scheme: Any, window: int, opts: dict) -> int:
    """config.max_position_embeddings after a RoPE rescaling: window x factor for schemes with an extended window,
    the window itself for the others (transformers' dynamic NTK reads it as the original window)."""
    factor = opts.get("factor")
    if scheme.max_positions != "extended" or factor is None or window is None:
        return window
    return math.ceil(window * factor)


def default_layer_types(config: PreTrainedConfig) -> list:
    """Where a config nests RoPE per layer type, the types a scaling applies to by default: the global-attention
    layers, as transformers' own legacy `rope_scaling` does (gemma3), else every type that has RoPE (some families
    give their global layers none)."""
    roped = [lt for lt in layer_types(config) if params_of(config, lt) is not None]
    return ["full_attention"] if "full_attention" in roped else roped


def apply_rope(model: PreTrainedModel, adapter: Adapter, req: dict, scheme: Any, edits: Edits) -> None:
    text_config = model.config.get_text_config()
    # not the scheme's own options: which layer types and layers it applies to, the trained window
    opts = {k: v for k, v in req.items() if k not in ("scheme", "layer_types", "layers",
                                                      "original_max_position_embeddings")}
    rotaries = rotaries_of(model, adapter)
    done = {}  # id(config) -> (new config the rotaries of that config read, per-type base params, window)
    for rotary, config in rotaries:
        if id(config) not in done:
            done[id(config)] = _rescale(model, adapter, req, scheme, opts, rotary, config, text_config, edits)
        rope_config, base, window, _ = done[id(config)]
        rotated = {lt: int(getattr(rotary, f"{prefix(lt)}inv_freq").count_nonzero()) for lt in base}
        if rope_config is not config:
            edits.set(rotary, "config", rope_config)
        rot.rebuild(rotary, rope_config, edits)
        if scheme.per_forward is not None:  # rescaled again at every forward (dynamic-yarn)
            scheme.per_forward(rotary, base, window, opts, edits)
        if scheme.frequencies is not None:  # a change transformers' parameters cannot express (p-RoPE)
            scheme.frequencies(rotary, rotated, opts, edits)


def keep_high_frequencies(rotary: nn.Module, rotated: dict, opts: dict, edits: Edits) -> None:
    """p-RoPE on a live rotary module: of the `rotated[layer_type]` pairs the model rotated before the patch, the
    highest-frequency floor(keep * n) keep their frequency and the others get 0 (no rotation). Where the native
    "proportional" parameters already did so, nothing changes."""
    for lt, n in rotated.items():
        kept = rope.kept_pairs(opts.get("keep", 0.75), n)
        if kept < 1:
            raise ValueError(f"keep={opts.get('keep')} leaves no rotary pair of the {n} this model rotates "
                             f"(it keeps floor(keep * {n})); use keep >= {1 / n:.3g}")
        name = f"{prefix(lt)}inv_freq"
        inv_freq = getattr(rotary, name)
        order = inv_freq.abs().argsort(descending=True, stable=True)
        masked = inv_freq.clone()
        masked[order[kept:]] = 0.0
        edits.set(rotary, name, masked)
        edits.set(rotary, f"{prefix(lt)}original_inv_freq", masked.clone())


def _rescale(model, adapter, req, scheme, opts, rotary, config, text_config, edits) -> tuple[Any, Any, Any, Any]:
    """The config `config`'s rotaries should read for this scheme: `config` itself, edited, when transformers can
    express the scheme there (so save_pretrained writes it natively), else a private copy."""
    original = config.rope_parameters
    all_types = layer_types(config)
    if all_types == [None]:
        if "layer_types" in req:
            raise ValueError(f"layer_types= applies to models with per-layer-type RoPE (gemma3); {adapter.model_type} "
                             "has one RoPE")
        targets = [None]
    else:
        targets = req.get("layer_types") or default_layer_types(config)
        unknown = sorted(set(targets) - set(all_types))
        if unknown:
            raise ValueError(f"unknown layer_types {unknown}; this model's RoPE layer types: {sorted(all_types)}")
        if any(original[lt] is None for lt in targets):
            raise ValueError(f"layer types {[lt for lt in targets if original[lt] is None]} have no RoPE to scale")
    new_params: dict = {}
    window = req.get("original_max_position_embeddings")
    for lt in targets:
        base = params_of(config, lt)
        window = window or trained_window(config, base)
        if window is None and scheme.max_positions == "extended":
            raise ValueError(f"position={req['scheme']!r} needs the trained window, and {adapter.model_type}'s config "
                             "names none (no max_position_embeddings): pass original_max_position_embeddings=")
        n_freq = getattr(rotary, f"{prefix(lt)}inv_freq").numel()  # rotated channels / 2
        for key in ("short_factor", "long_factor"):
            if key in opts and len(opts[key]) != n_freq:
                raise ValueError(
                    f"{key} must have one entry per rotary frequency: {n_freq} for this model "
                    f"(rotary dim {2 * n_freq}), got {len(opts[key])}"
                )
        new_params[lt] = scheme.rope(base, window, opts, 2 * n_freq)
    rope_parameters = new_params[None] if targets == [None] else {**original, **new_params}
    n_positions = max_positions(scheme, window, opts)
    native = (scheme.native and config is text_config and native_form_kept(config, rope_parameters, n_positions)
              and _fits_natively(rotary, config, rope_parameters, targets)
              and (scheme.native_for is None or all(scheme.native_for(params_of(config, lt)) for lt in targets)))
    base = {lt: params_of(config, lt) for lt in targets}
    if native:
        # The config describes the patch in transformers' own terms, so plain from_pretrained reloads it.
        edits.set(config, "max_position_embeddings", n_positions) if n_positions else None
        edits.set(config, "rope_parameters", rope_parameters)
        if hasattr(config, "original_max_position_embeddings"):
            # phi3's standardization copies this attribute over rope_parameters' own value: keep them equal.
            edits.set(config, "original_max_position_embeddings", window)
        return config, base, window, n_positions
    # The model's config keeps its original RoPE (its class cannot express this scheme); the rotary module
    # reads a private copy that does, and the hfpatch record carries the scheme through save/reload.
    if config is text_config and n_positions:
        edits.set(config, "max_position_embeddings", n_positions)
    rope_config = copy.copy(config)
    rope_config.rope_parameters = rope_parameters
    rope_config.max_position_embeddings = n_positions
    if hasattr(config, "original_max_position_embeddings"):
        rope_config.original_max_position_embeddings = window
    return rope_config, base, window, n_positions


def _fits_natively(rotary: nn.Module, config: PreTrainedConfig, rope_parameters: dict, targets: list) -> bool:
    """Whether transformers, built from these parameters, computes buffers of the shapes the model rotates with
    (not so where hfpatch pads a partial rotation's frequencies with zeros: rot.fitted)."""
    trial = copy.copy(config)
    trial.rope_parameters = rope_parameters
    for lt in targets:
        inv_freq, _ = rot.compute(rotary, trial, lt)
        if inv_freq.shape != getattr(rotary, f"{prefix(lt)}inv_freq").shape:
            return False
    return True


def native_form_kept(config: PreTrainedConfig, rope_parameters: dict, n_positions: int | None = None) -> bool:
    """Whether `config`'s class keeps these rope_parameters as given when it builds a config from them (Phi3Config
    rewrites yarn to longrope and rejects other types), i.e. whether config.json can carry them natively. The trial
    config has the max_position_embeddings the patch writes (n_positions), as the patched config will: with the old
    one, transformers' check of llama3's parameters warns that the original window is not below it."""
    def types(params) -> Any:
        if "rope_type" in params:
            return params["rope_type"]
        return {k: v and v.get("rope_type") for k, v in params.items()}

    data = {k: v for k, v in config.to_dict().items() if k != "hfpatch"}
    data["rope_parameters"] = copy.deepcopy(rope_parameters)
    if n_positions:
        data["max_position_embeddings"] = n_positions
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            built = type(config).from_dict(data)
    except Exception:  # the class refuses them
        return False
    got = getattr(built, "rope_parameters", None)
    return isinstance(got, dict) and types(got) == types(rope_parameters)


def apply_nope(model: PreTrainedModel, adapter: Adapter, req: dict, scheme: Any, edits: Edits) -> None:
    """No position signal at all: the model's own is taken out and nothing is put in."""
    remove_positions(model, adapter, req["scheme"], edits)


def apply_sinusoidal(model: PreTrainedModel, adapter: Adapter, req: dict, scheme: Any, edits: Edits) -> None:
    """The fixed sinusoidal table, carried by the learned table's lookup (which returns its rows instead) or, in a
    model without a table, added to the first block's input."""
    base = model.base_model
    remove_positions(model, adapter, req["scheme"], edits, lookup=absolute.SinusoidalPositions)
    if adapter.position_table:
        carrier = get_path(base, adapter.position_table)
        edits.set(carrier, "hfpatch_offset", adapter.position_offset)
    else:
        carrier = get_path(base, adapter.layers)[0]
        edits.mix_in(carrier, absolute.SinusoidalInput)
    if "pe_scale" in req:
        edits.set(carrier, absolute.SCALE_ATTR, float(req["pe_scale"]))


def apply_interpolate(model: PreTrainedModel, adapter: Adapter, req: dict, scheme: Any, edits: Edits) -> None:
    """A learned position table stretched to factor x its length by linear interpolation of its rows."""
    base = model.base_model
    path = cast(str, adapter.position_table)  # the scheme requires a table (its Requirement)
    table = get_path(base, path)
    rows = math.ceil((table.num_embeddings - adapter.position_offset) * req["factor"]) + adapter.position_offset
    # interpolate_rows works in float64: the positions, two gathered copies and their blend
    absolute.check_table_fits(rows, table.embedding_dim, table.weight, f"position='interpolate' with "
                              f"factor={req['factor']:g}", working=4)
    new = absolute.interpolate_rows(table.weight.detach(), req["factor"], keep=adapter.position_offset)
    n_positions = new.shape[0] - adapter.position_offset
    edits.set(table, "weight", torch.nn.Parameter(new, requires_grad=table.weight.requires_grad))
    edits.set(table, "num_embeddings", new.shape[0])
    edits.set(model.config.get_text_config(), "max_position_embeddings", n_positions)
    # BERT keeps position_ids / token_type_ids buffers of the table's length
    owner = get_path(base, path.rpartition(".")[0]) if "." in path else base
    for name, fill in (("position_ids", "arange"), ("token_type_ids", "zeros")):
        buf = getattr(owner, "_buffers", {}).get(name)
        if buf is not None:
            grown = torch.arange(n_positions, dtype=buf.dtype, device=buf.device) if fill == "arange" else \
                torch.zeros(n_positions, dtype=buf.dtype, device=buf.device)
            edits.set(owner, name, grown.expand(*buf.shape[:-1], n_positions))
