"""Context extension: patch a pretrained model's position encoding (e.g. YaRN x4) and fine-tune at the new length.

    accelerate launch recipes/context_extension.py --config recipes/configs/context_extension_tiny_yarn4.yaml

`seq_len` must fit what the patched model supports (e.g. 4 x the trained window with yarn factor 4): checked before
training. Full fine-tuning, or LoRA with lora.enabled=true (the patch and the adapters coexist).
"""

import sys

from hfpatch.train import cli, data, loop, setup
from hfpatch.train.config import ContextExtensionConfig


def main(cfg: ContextExtensionConfig) -> dict:
    model, tok = setup.load(cfg)
    setup.apply_patch(model, cfg)
    train_seqs, eval_seqs = data.packed(cfg, tok)
    return loop.train(cfg, model, tok, train_seqs, eval_seqs)


if __name__ == "__main__":
    sys.exit(cli.run("context_extension", main))
