"""Where one long training step's memory goes: every tensor the step allocates is followed from its creation to its
release, labelled with the module and phase that made it, and the live set is read at the step's peak.

    python -m eval.memory_breakdown --length 16384                 # SmolLM2 shape, 8 layers, the recipe's options
    python -m eval.memory_breakdown --length 16384 --variant plain # transformers' own loss, checkpointing on
    python -m eval.memory_breakdown --length 4096 --rope           # what RoPE allocates and keeps, per layer

How: a TorchDispatchMode sees every op's outputs; each new storage is counted once (views and in-place results
share it) and released when the last tensor object pointing at it dies (weakref finalizers). Tensors autograd keeps
for the backward pass are packed as detached tensors (a saved-tensor hook), so they stay visible as Python objects.
Parameters and inputs exist before the step and are not counted; op-internal workspace (inside one kernel) is not
visible either, which is why the process's peak RSS is reported beside it.

Labels: module forward hooks name the innermost module running (layers.3.mlp.up_proj); the phase is forward,
recompute (a checkpointed block re-run in the backward pass), backward (grad_fn name, with the last block
recomputed) or optimizer.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers.models.llama import modeling_llama

from eval.benchutil import markdown_table, peak_rss, reset_peak_rss, rss, smollm2_shaped
from hfpatch.train import memory
from hfpatch.train.loop import CausalLMLoss
from hfpatch.utils.files import write_json

MB = 2**20


class LiveTensors(TorchDispatchMode):
    """Live bytes of the storages created under this mode, with a label per storage and the live set at the peak."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, list] = {}  # data_ptr -> [nbytes, label, tensor objects alive]
        self.total = self.peak = 0
        self.at_peak: list[tuple[int, int, tuple]] = []  # (data_ptr, nbytes, label)
        self.peak_label: tuple = ()
        self.phase, self.module, self.last_block = "forward", "-", "-"
        self.shapes: list[tuple[tuple, tuple, int]] = []  # (label, shape, nbytes) of every new storage
        self.phase_peak: dict[str, int] = {}  # the largest live total seen in each phase
        self.phase_snap: dict[str, tuple] = {}  # phase -> (live total, [(nbytes, label)]) near its peak
        # the process's resident set after each op: it also holds what the tracker cannot see (memory inside one
        # op, and memory the allocator keeps after tensors are freed)
        self._status = open("/proc/self/statm", "rb", buffering=0)  # noqa: SIM115 (read after every op while tracking)
        self._page = os.sysconf("SC_PAGE_SIZE")
        self.rss_peak, self.rss_peak_label, self.live_at_rss_peak = 0, (), 0

    def label(self) -> tuple:
        # The autograd engine runs backward nodes with grad mode off; a checkpoint's recomputation runs with it on
        # (and may stop early by an exception, so the module label is only read there)
        if self.phase == "backward" and not torch.is_grad_enabled():
            node = torch._C._current_autograd_node()
            return ("backward", self.last_block, node.name() if node is not None else "?")
        phase = "recompute" if self.phase == "backward" else self.phase
        return (phase, self.module, "")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self._track(t)
        self._status.seek(0)
        resident = int(self._status.read().split()[1]) * self._page
        if resident > self.rss_peak:
            self.rss_peak, self.rss_peak_label, self.live_at_rss_peak = resident, self.label(), self.total
        phase = self.label()[0]
        self.phase_peak[phase] = max(self.phase_peak.get(phase, 0), self.total)
        return out

    def _track(self, t):
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if ptr == 0 or nbytes == 0:
            return
        entry = self.live.get(ptr)
        if entry is None:
            entry = self.live[ptr] = [nbytes, self.label(), 0]
            self.shapes.append((entry[1], tuple(t.shape), nbytes))
            self.total += nbytes
            if self.total > self.peak:
                self.peak = self.total
                if not self.at_peak or self.total > self._snap_total + MB:  # snapshot again only after 1 MB more
                    self.at_peak = [(p, e[0], e[1]) for p, e in self.live.items()]
                    self._snap_total = self.total
                    self.peak_label = entry[1]
            phase = entry[1][0]
            if self.total > self.phase_snap.get(phase, (0, None))[0] + MB:  # the live set at each phase's peak
                self.phase_snap[phase] = (self.total, [(e[0], e[1]) for e in self.live.values()])
        entry[2] += 1
        weakref.finalize(t, self._release, ptr, entry)

    def _release(self, ptr, entry):
        entry[2] -= 1
        if entry[2] == 0 and self.live.get(ptr) is entry:
            del self.live[ptr]
            self.total -= entry[0]


def _detach(t):
    return t.detach()


def label_modules(model, tracker: LiveTensors):
    """Forward hooks that keep tracker.module = the innermost module running (its path in the model), and in the
    backward pass tracker.last_block = the block recomputed last."""
    handles = []
    for name, module in model.named_modules():
        if not name:
            continue

        def pre(mod, args, name=name):
            tracker.module = name
            if tracker.phase == "backward" and ".layers." in name:
                tracker.last_block = ".".join(name.split(".")[:3])  # model.layers.3

        def post(mod, args, out, name=name):
            tracker.module = name.rpartition(".")[0] or "-"

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    return handles


def group(entries, key) -> dict:
    out = collections.Counter()
    for nbytes, label in entries:
        out[key(label)] += nbytes
    return dict(out.most_common())


def part_of(label) -> str:
    """A coarse name for what made a storage: the sub-module kind inside a block, or the loss/embedding/other."""
    phase, module, node = label
    if not module:  # parameter gradients, optimizer state
        return phase
    parts = module.split(".")
    if ".layers." in module:
        inner = parts[3:]
        kind = inner[0] if inner else "block"
        if kind == "self_attn" and len(inner) > 1:
            kind = "self_attn." + inner[1]
        return kind
    if phase == "backward":
        return "backward (" + node + ")"
    return module


def run(args) -> dict:
    model = smollm2_shaped(args.layers, args.length)
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (1, args.length), generator=torch.Generator().manual_seed(0))
    if args.release:
        memory.release_freed_memory()
    if args.variant == "plain":
        model.activation_checkpointing_enable({"use_reentrant": False})
        step_module = None
    else:
        edits = memory.apply(model, gradient_checkpointing=True, mlp_tile=args.mlp_tile)
        step_module = CausalLMLoss(model, chunk=args.loss_chunk, fused=args.fused_loss)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, **({"fused": True} if args.fused else {}))
    tracker = LiveTensors()
    handles = label_modules(model, tracker)
    base = rss()
    tracker.rss_peak = base
    reset_peak_rss()
    with tracker, torch.autograd.graph.saved_tensors_hooks(_detach, lambda t: t):
        tracker.phase = "forward"
        if step_module is None:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        else:
            loss = step_module(ids)[0]
        after_forward = group([(e[0], e[1]) for e in tracker.live.values()], part_of)
        held_after_forward = tracker.total
        tracker.phase = "backward"
        loss.backward()
        tracker.phase, tracker.module = "optimizer", "-"
        opt.step()
        # what the peak's storages were: parameter gradients and optimizer state are alive until here
        kinds = {(p.grad.untyped_storage().data_ptr(), p.grad.untyped_storage().nbytes()): "parameter gradients"
                 for p in params}
        kinds.update({(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()): "optimizer state"
                      for state in opt.state.values() for t in state.values() if t.numel() > 1})
        opt.zero_grad(set_to_none=True)
    for h in handles:
        h.remove()
    if step_module is not None:
        edits.undo()
    at_peak = [(n, (kinds[(p, n)], "", "") if (p, n) in kinds else lab) for p, n, lab in tracker.at_peak]
    return {
        "variant": args.variant, "length": args.length, "layers": args.layers, "loss": loss.item(),
        "tracked_peak_mb": tracker.peak / MB, "peak_during": list(tracker.peak_label),
        "process_peak_above_start_mb": (peak_rss() - base) / MB,
        "resident_peak_after_an_op_above_start_mb": (tracker.rss_peak - base) / MB,
        "resident_peak_during": list(tracker.rss_peak_label),
        "tracked_live_at_resident_peak_mb": tracker.live_at_rss_peak / MB,
        "tracked_peak_by_phase_mb": {k: v / MB for k, v in tracker.phase_peak.items()},
        "held_after_forward_mb": held_after_forward / MB,
        "after_forward_by_part_mb": {k: v / MB for k, v in after_forward.items()},
        "at_peak_by_phase_mb": {k: v / MB for k, v in group(at_peak, lambda lab: lab[0]).items()},
        "at_peak_by_part_mb": {k: v / MB for k, v in group(at_peak, lambda lab: f"{lab[0]}: {part_of(lab)}").items()},
        "at_phase_peaks_by_part_mb": {
            phase: {k: v / MB for k, v in group(entries, lambda lab: f"{lab[0]}: {part_of(lab)}").items()}
            for phase, (_, entries) in tracker.phase_snap.items()},
        "at_peak_by_layer_mb": {k: v / MB for k, v in group(
            at_peak, lambda lab: ".".join(lab[1].split(".")[:3]) if ".layers." in lab[1] else lab[1]).items()},
    }


def rope_report(args) -> dict:
    """One layer's forward with autograd on and no checkpointing: what apply_rotary_pos_emb allocates and which of
    it is still alive after the forward (kept for the backward pass)."""
    model = smollm2_shaped(args.layers, args.length)
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (1, args.length), generator=torch.Generator().manual_seed(0))
    tracker = LiveTensors()
    original = modeling_llama.apply_rotary_pos_emb

    def labelled(*a, **kw):
        before, tracker.module = tracker.module, tracker.module + ".rope"
        try:
            return original(*a, **kw)
        finally:
            tracker.module = before

    handles = label_modules(model, tracker)
    modeling_llama.apply_rotary_pos_emb = labelled
    try:
        with tracker, torch.autograd.graph.saved_tensors_hooks(_detach, lambda t: t):
            hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
            alive = [(e[0], e[1]) for e in tracker.live.values()]
    finally:
        modeling_llama.apply_rotary_pos_emb = original
        for h in handles:
            h.remove()
    del hidden
    cfg = model.config
    bhld = (1, cfg.num_attention_heads, args.length, cfg.head_dim)
    rope_made = [(lab, shape, n) for lab, shape, n in tracker.shapes if lab[1].endswith(".rope")]
    per_layer = collections.Counter()
    for _, shape, _ in rope_made:
        per_layer[shape] += 1
    layer0 = "model.layers.0.self_attn.rope"
    return {
        "length": args.length, "q_shape [B,H,L,D]": list(bhld),
        "rope_allocations_per_layer_by_shape": {str(list(s)): c // args.layers for s, c in per_layer.items()},
        "rope_alive_after_forward_mb_layer0": sum(n for n, lab in alive if lab[1] == layer0) / MB,
        "rope_alive_after_forward_mb_all_layers": sum(n for n, lab in alive if lab[1].endswith(".rope")) / MB,
        "rotary_module_alive_after_forward_mb": sum(n for n, lab in alive if lab[1] == "model.rotary_emb") / MB,
        "alive_after_forward_by_part_layer0_mb": {k: v / MB for k, v in group(
            [(n, lab) for n, lab in alive if lab[1].startswith("model.layers.0.")], part_of).items()},
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=int, default=16384)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--variant", choices=["recipe", "plain"], default="recipe")
    p.add_argument("--loss-chunk", type=int, default=512, dest="loss_chunk")
    p.add_argument("--mlp-tile", type=int, default=None, dest="mlp_tile")
    p.add_argument("--fused", action="store_true", help="torch's fused AdamW (fused_optimizer: true)")
    p.add_argument("--fused-loss", action="store_true", dest="fused_loss", help="the recipe's fused_loss: true")
    p.add_argument("--release", action="store_true", help="the recipe's release_memory: true")
    p.add_argument("--rope", action="store_true", help="report what RoPE allocates and keeps instead")
    p.add_argument("--json")
    args = p.parse_args(argv)
    torch.set_grad_enabled(True)
    result = rope_report(args) if args.rope else run(args)
    print(json.dumps(result, indent=1))
    if not args.rope:
        print(table(result))
    if args.json:
        write_json(Path(args.json), result)
    return result


def table(result: dict) -> str:
    """What was held at the tracked peak, by phase and part (the --json form: also what eval/docs_tables.py
    renders)."""
    return markdown_table(["held at the peak", "MB"],
                          [[k, f"{v:.0f}"] for k, v in list(result["at_peak_by_part_mb"].items())[:25]])


if __name__ == "__main__":
    main()
