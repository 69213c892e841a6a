"""The contract of hfpatch/edits.py, the one layer that mutates models, tested on its own: every change is undone
with the very objects that were there before (in the same kind of slot: attribute, parameter, buffer with its
persistence, submodule, class), redo puts back the very objects undo removed, and a log survives copying."""

import copy
import pickle

import pytest
import torch
from conftest import assert_same_fingerprint, fingerprint, tiny_model
from torch import nn
from transformers import GPT2Config

from hfpatch.edits import _KEYS, MISSING, Edits, with_mixin


def holder():
    """A module with one of everything an edit can meet."""
    m = nn.Module()
    m.plain = "original"
    m.weight = nn.Parameter(torch.randn(3))
    m.register_buffer("kept", torch.randn(3))  # persistent
    m.register_buffer("cache", torch.randn(3), persistent=False)
    m.register_buffer("steps", torch.arange(3))  # not floating point
    m.child = nn.Linear(2, 2)
    return m


def slots(m):
    """Where every name lives, with buffers' persistence."""
    return {"dict": sorted(k for k in vars(m) if not k.startswith("_") and k != "training"),
            "params": sorted(m._parameters), "buffers": sorted(m._buffers),
            "non_persistent": sorted(m._non_persistent_buffers_set), "modules": sorted(m._modules),
            "state_dict": sorted(m.state_dict())}


def test_set_and_undo_restore_the_very_objects():
    m = holder()
    before = {name: getattr(m, name) for name in ("plain", "weight", "kept", "cache", "steps", "child")}
    layout = slots(m)
    e = Edits()
    e.set(m, "plain", "patched")
    e.set(m, "weight", nn.Parameter(torch.zeros(3)))
    e.set(m, "kept", torch.zeros(3))
    e.set(m, "cache", torch.zeros(3))
    e.set(m, "steps", torch.zeros(3, dtype=torch.long))
    e.set(m, "child", nn.Identity())
    e.set(m, "added", 1)
    assert len(e) == 7 and m.plain == "patched" and isinstance(m.child, nn.Identity) and m.added == 1
    # replacing a buffer keeps it a buffer, with its persistence
    assert [slots(m)[k] for k in ("buffers", "non_persistent")] == [layout[k] for k in ("buffers", "non_persistent")]
    e.undo()
    assert len(e) == 0
    for name, obj in before.items():
        assert getattr(m, name) is obj, name
    assert not hasattr(m, "added")
    assert slots(m) == layout


def test_undo_goes_newest_first_and_touched_reports_the_first_value():
    m = holder()
    e = Edits()
    e.set(m, "plain", "one")
    e.set(m, "plain", "two")
    e.set(m, "fresh", 1)
    assert e.touched(m) == {"plain": "original", "fresh": MISSING}
    e.undo()
    assert m.plain == "original" and not hasattr(m, "fresh")


def deleting(obj, *names):
    """An Edits log that deleted `names` of `obj`, in that order."""
    e = Edits()
    for name in names:
        e.delete(obj, name)
    return e


def test_deleted_buffers_come_back_as_buffers_with_their_persistence():
    m = holder()
    kept, cache, layout = m.kept, m.cache, slots(m)
    e = deleting(m, "kept", "cache", "never_there")  # nothing to delete for never_there: nothing logged
    assert len(e) == 2 and "kept" not in m.state_dict()
    e.undo()
    assert m.kept is kept and m.cache is cache
    assert slots(m) == layout
    m.double()  # buffers follow the module; a plain attribute would not
    assert m.kept.dtype == m.cache.dtype == torch.float64


def test_deleted_parameters_and_submodules_come_back_in_their_slots():
    m = holder()
    weight, child, layout = m.weight, m.child, slots(m)
    e = deleting(m, "weight", "child", "plain")
    e.undo()
    assert m.weight is weight and m.child is child and m.plain == "original"
    assert slots(m) == layout


def test_a_change_of_kind_is_undone_and_redone():
    """A plain attribute replaced by a module, a buffer replaced by a parameter: undo puts each original back in its
    own kind of slot (nn.Module refuses to assign a plain value over a submodule, or a tensor over a parameter)."""
    m = holder()
    plain, cache, layout = m.plain, m.cache, slots(m)
    module, param = nn.Linear(1, 1), nn.Parameter(torch.ones(3))
    e = Edits()
    e.set(m, "plain", module)
    e.set(m, "cache", param)
    e.undo()
    assert m.plain is plain and m.cache is cache and slots(m) == layout
    e.redo()
    assert m.plain is module and "plain" in m._modules and m.cache is param and "cache" in m._parameters
    e.undo()
    assert slots(m) == layout


def test_redo_puts_back_the_very_objects_undo_removed_trained_values_included():
    m = holder()
    new = nn.Parameter(torch.zeros(3))
    e = Edits()
    e.set(m, "weight", new)
    e.set(m, "cache", torch.zeros(3))
    with torch.no_grad():
        new.add_(5.0)  # trained after the patch
    e.undo()
    e.redo()
    assert m.weight is new and torch.equal(m.weight, torch.full((3,), 5.0))
    assert "cache" in m._non_persistent_buffers_set and len(e) == 2
    e.undo()
    assert m.weight is not new


def test_undo_after_a_dtype_move_gives_the_saved_values_in_the_new_dtype():
    m = holder()
    weight, kept, steps = m.weight.detach().clone(), m.kept.clone(), m.steps.clone()
    e = Edits()
    e.set(m, "weight", nn.Parameter(torch.zeros(3)))
    e.set(m, "kept", torch.zeros(3))
    e.set(m, "steps", torch.zeros(3, dtype=torch.long))
    m.double()
    e.undo()
    assert isinstance(m.weight, nn.Parameter) and m.weight.requires_grad and m.weight.dtype == torch.float64
    assert torch.equal(m.weight.detach(), weight.double()) and torch.equal(m.kept, kept.double())
    assert m.steps.dtype == torch.long and torch.equal(m.steps, steps)


def test_swap_class_and_mix_in():
    class Doubled:
        def forward(self, x):
            return 2 * super().forward(x)

    lin = nn.Linear(2, 2)
    x = torch.randn(1, 2)
    plain = lin(x)
    e = Edits()
    with pytest.raises(TypeError, match="must subclass Linear"):
        e.swap_class(lin, nn.Conv1d)
    assert len(e) == 0 and type(lin) is nn.Linear
    e.mix_in(lin, Doubled)
    assert isinstance(lin, nn.Linear) and torch.allclose(lin(x), 2 * plain)
    assert type(lin) is with_mixin(nn.Linear, Doubled)  # one class per pair, reused
    other = nn.Linear(2, 2)
    e.mix_in(other, Doubled)
    assert type(other) is type(lin)
    e.undo()
    assert type(lin) is nn.Linear and type(other) is nn.Linear and torch.equal(lin(x), plain)
    e.redo()
    assert type(lin) is with_mixin(nn.Linear, Doubled)


def test_mix_in_under_keeps_the_class_own_method_first():
    """under=True: the class's own forward runs and reaches the mixin (a replacement of its base's method)
    through super()."""
    class Base(nn.Module):
        def forward(self, x):
            return x + 1

    class Outer(Base):
        def forward(self, x):
            return super().forward(x) * 10

    class Minus(Base):
        def forward(self, x):
            return x - 1

    m = Outer()
    e = Edits()
    e.mix_in(m, Minus, under=True)
    assert m(torch.tensor(5.0)) == 40.0  # (5 - 1) * 10: Outer first, then Minus instead of Base
    e.undo()
    assert type(m) is Outer and m(torch.tensor(5.0)) == 60.0


def test_track_new_attributes_drops_what_appears_later_and_redo_brings_it_back():
    m = holder()
    e = Edits()
    e.track_new_attributes(m)
    cache, extra = torch.ones(2), object()
    m.register_buffer("rope_cache", cache, persistent=False)
    m.extra = extra
    m.plain = "changed without the log"  # existed before: not the log's business
    e.undo()
    assert not hasattr(m, "rope_cache") and not hasattr(m, "extra") and m.plain == "changed without the log"
    e.redo()
    assert m.rope_cache is cache and m.extra is extra and "rope_cache" in m._non_persistent_buffers_set
    assert e.touched(m) == {}  # the key-set marker is not an attribute


def test_config_legacy_names_are_followed():
    config = GPT2Config(n_positions=64)
    e = Edits()
    e.set(config, "max_position_embeddings", 256)  # GPT-2 stores it as n_positions
    assert config.n_positions == 256 and e.touched(config) == {"max_position_embeddings": 64}
    e.set(config, "brand_new", 1)
    e.undo()
    assert config.n_positions == 64 and not hasattr(config, "brand_new")


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_log_carried_by_a_copied_model_undoes_the_copy(how):
    """Markers are compared by identity: they stay themselves through deepcopy and pickle, so the copy's log
    deletes the attributes it added (old value MISSING) on the copy, and the original is not touched."""
    assert copy.deepcopy(MISSING) is MISSING and pickle.loads(pickle.dumps(_KEYS)) is _KEYS
    m = holder()
    e = Edits()
    e.set(m, "plain", "patched")
    e.set(m, "added", 1)
    e.track_new_attributes(m)
    m.later = 2
    object.__setattr__(m, "log", e)
    c = copy.deepcopy(m) if how == "deepcopy" else pickle.loads(pickle.dumps(m))
    c.log.undo()
    assert c.plain == "original" and not hasattr(c, "added") and not hasattr(c, "later")
    assert m.plain == "patched" and m.added == 1 and m.later == 2


def test_a_failure_half_way_is_undone_completely():
    """Edits of every kind on a real model, then one that nn.Module refuses: undo restores the model exactly."""
    model = tiny_model("llama")
    before = fingerprint(model)
    layer = model.model.layers[0]
    e = Edits()
    e.set(layer, "input_layernorm", nn.LayerNorm(64))
    e.set(model.model.rotary_emb, "inv_freq", torch.zeros_like(model.model.rotary_emb.inv_freq))
    e.set(model.config, "max_position_embeddings", 4096)
    e.delete(layer.self_attn, "scaling")
    e.mix_in(layer.mlp, Noisy)
    with pytest.raises(TypeError, match="cannot assign"):
        e.set(layer.self_attn.q_proj, "weight", torch.zeros(64, 64))  # a plain tensor over a parameter
    e.undo()
    assert len(e) == 0
    assert_same_fingerprint(before, fingerprint(model))


class Noisy:
    def forward(self, x):
        return super().forward(x) + 1
