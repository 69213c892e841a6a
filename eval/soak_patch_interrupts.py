"""Interrupt soak for patch, re-patch and unpatch.

A KeyboardInterrupt is raised at every point where hfpatch reads or writes a model attribute through its edit log
(`hfpatch.edits`: each value read before a change, each value put back, each class swap), one point per run, in
every operation below; after each, the model must be exactly its state before the call or after it: logits,
`describe()`, the config (the hfpatch record included) and every module's class. Then `unpatch` must give the
original model back.

    python -m eval.soak_patch_interrupts                                  # 4 families x 4 operations
    python -m eval.soak_patch_interrupts --families llama gpt2 --ops repatch unpatch

tests/test_interrupts.py runs the same functions on one tiny model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

import torch

import hfpatch
import hfpatch.edits
from hfpatch import tiny

# operation: (what is done before, the call under test); each a function of the model
OPERATIONS = {
    "patch": (lambda m: None, lambda m: hfpatch.patch(m, position="yarn", factor=4.0)),
    "repatch": (lambda m: hfpatch.patch(m, position="yarn", factor=4.0),
                lambda m: hfpatch.patch(m, position="ntk", factor=2.0)),
    # norm comes before position in the order of axes: the position patch is undone and applied again
    "repatch-norm": (lambda m: hfpatch.patch(m, position="yarn", factor=4.0),
                     lambda m: hfpatch.patch(m, norm="rmsnorm")),
    "unpatch": (lambda m: hfpatch.patch(m, position="yarn", factor=4.0, norm="rmsnorm"), hfpatch.unpatch),
}
FAMILIES = ("llama", "gemma3_text", "gpt_neox", "olmo2")


class Interrupt:
    """Counts the edit log's points while active; raises KeyboardInterrupt at point `at` (once), if given."""

    POINTS = (("module", "_held"), ("module", "_put"), ("Edits", "swap_class"))

    def __init__(self, at: int | None = None):
        self.at, self.count = at, 0

    def _wrap(self, fn):
        def point(*args, **kwargs):
            self.count += 1
            if self.count - 1 == self.at:
                raise KeyboardInterrupt(f"injected at point {self.at}")
            return fn(*args, **kwargs)

        return point

    @contextlib.contextmanager
    def active(self):
        owners = {"module": hfpatch.edits, "Edits": hfpatch.edits.Edits}
        saved = [(owners[o], name, getattr(owners[o], name)) for o, name in self.POINTS]
        try:
            for owner, name, fn in saved:
                setattr(owner, name, self._wrap(fn))
            yield self
        finally:
            for owner, name, fn in saved:
                setattr(owner, name, fn)


@torch.no_grad()
def state(model, ids) -> dict:
    """What must be exactly the before or the after state."""
    info = hfpatch.describe(model)
    return {"logits": model(input_ids=ids, use_cache=False).logits, "config": model.config.to_dict(),
            "describe": {k: info[k] for k in ("norm", "placement", "position", "applied", "max_position_embeddings")},
            "classes": [type(m).__name__ for m in model.modules()]}


def same(a: dict, b: dict) -> bool:
    return torch.equal(a["logits"], b["logits"]) and all(a[k] == b[k] for k in ("config", "describe", "classes"))


def soak(family: str, operation: str, points: int | None = None) -> dict:
    """Interrupt `operation` on a tiny `family` model at each point (or the first `points`); returns the number of
    points, how many runs ended in the before / after state, and the points that left anything else."""
    setup, call = OPERATIONS[operation]
    ids = tiny.sample_ids(1, tiny.WINDOW + 16)

    def fresh():
        model = tiny.build_tiny(family)
        setup(model)
        return model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads cost far more than they gain
    try:
        return _soak(fresh, call, ids, family, operation, points)
    finally:
        torch.set_num_threads(threads)


def _soak(fresh, call, ids, family: str, operation: str, points: int | None) -> dict:
    original, before = state(tiny.build_tiny(family), ids), state(fresh(), ids)
    model = fresh()  # counted as the runs below go: the adapter is read inside the call, not cached before it
    with Interrupt().active() as counter:
        call(model)
    after, total = state(model, ids), counter.count
    out = {"family": family, "operation": operation, "points": total, "before": 0, "after": 0, "bad": []}
    for at in range(total if points is None else min(points, total)):
        model = fresh()
        with contextlib.suppress(KeyboardInterrupt), Interrupt(at).active():
            call(model)
        now = state(model, ids)
        kind = "before" if same(now, before) else "after" if same(now, after) else None
        hfpatch.unpatch(model)
        if kind is None or not same(state(model, ids), original):
            out["bad"].append(at)
        else:
            out[kind] += 1
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", nargs="+", default=list(FAMILIES))
    p.add_argument("--ops", nargs="+", default=list(OPERATIONS), choices=list(OPERATIONS))
    p.add_argument("--out", help="write the results as JSON")
    args = p.parse_args(argv)
    results, start = [], time.time()
    for family in args.families:
        for op in args.ops:
            with tiny.quiet():
                r = soak(family, op)
            results.append(r)
            print(f"{family:12s} {op:13s} points {r['points']:4d}  before {r['before']:4d}  after {r['after']:4d}  "
                  f"bad {len(r['bad'])} {r['bad'][:10]}", flush=True)
    total = sum(r["points"] for r in results)
    bad = sum(len(r["bad"]) for r in results)
    print(f"{total} interrupts, {bad} left a state that was neither before nor after ({time.time() - start:.0f} s)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"results": results, "interrupts": total, "bad": bad}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
