"""Healing: after a norm / placement / position swap, fine-tune to recover the original model's quality.

    accelerate launch recipes/heal.py --config recipes/configs/heal_smollm2_layernorm.yaml [key=value ...]

With distill.enabled the loss is (1 - alpha) * CE + alpha * T^2 * KL(original || patched), the KL taken against
the unpatched model's logits, chunk by chunk (loss_chunk positions at a time), so long sequences fit. With
calibrate: N, hfpatch.calibrate first fits what the patch put in (a DyT's α, ...) on N training sequences.
"""

import copy
import sys

from hfpatch.train import cli, data, loop, setup
from hfpatch.train.config import HealConfig


def main(cfg: HealConfig) -> dict:
    model, tok = setup.load(cfg)
    teacher = copy.deepcopy(model).eval() if cfg.distill.enabled else None  # the model before the swap
    setup.apply_patch(model, cfg)
    train_seqs, eval_seqs = data.packed(cfg, tok)
    setup.calibrate(model, cfg, train_seqs)  # with calibrate: N, training starts from the fitted patch
    return loop.train(cfg, model, tok, train_seqs, eval_seqs, teacher=teacher)


if __name__ == "__main__":
    sys.exit(cli.run("heal", main))
