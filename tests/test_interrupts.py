"""patch, re-patch and unpatch are atomic under BaseException: a KeyboardInterrupt at any point of the edit log leaves
the model exactly as it was before the call or after it (eval/soak_patch_interrupts.py runs more families), and a
real Ctrl-C during a patch is delivered once the patch is complete."""

from __future__ import annotations

import signal

import pytest
import torch

import hfpatch
import hfpatch.apply
from eval import soak_patch_interrupts as soak_module
from hfpatch import tiny


@pytest.mark.parametrize("operation", list(soak_module.OPERATIONS))
def test_an_interrupt_at_every_edit_point_leaves_the_before_or_the_after_state(operation):
    result = soak_module.soak("llama", operation)
    assert result["points"] >= 10, result  # the injection reaches the edit log
    assert result["bad"] == [], result
    assert result["before"] > 0, result  # interrupts that landed inside the call, not only after it


def test_a_real_ctrl_c_during_a_patch_lands_after_it():
    model = tiny.build_tiny("llama")
    real = hfpatch.apply.apply_axes

    def signal_then_apply(*args, **kwargs):  # Ctrl-C as the first edit of the patch is about to be made
        signal.raise_signal(signal.SIGINT)  # to this (main) thread, at once; the handler runs at the next bytecode
        return real(*args, **kwargs)

    # Python's own Ctrl-C handler, as a user's process has it: code run earlier in this process (a library's
    # worker set-up, seen in a full test run) can leave SIGINT ignored, and an ignored Ctrl-C is not delivered
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    hfpatch.apply.apply_axes = signal_then_apply
    try:
        with pytest.raises(KeyboardInterrupt):
            hfpatch.patch(model, position="yarn", factor=4.0)
    finally:
        hfpatch.apply.apply_axes = real
        signal.signal(signal.SIGINT, previous)
    assert hfpatch.describe(model)["applied"]["position"]["scheme"] == "yarn"  # complete, then interrupted
    reference = hfpatch.patch(tiny.build_tiny("llama"), position="yarn", factor=4.0)
    ids = tiny.sample_ids(1, 80)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
