"""Train a small model from scratch with any hfpatch spec, to compare position / norm schemes on equal terms.

    accelerate launch recipes/pretrain.py --config recipes/configs/pretrain_tiny_llama.yaml [key=value ...]

The model is built from `model_config` (a transformers config: model_type and sizes; the vocabulary comes from the
tokenizer), patched with `patch` before training, and saved with hfpatch.save_pretrained to output_dir/final.
"""

import sys

from hfpatch.train import cli, data, loop, setup
from hfpatch.train.config import PretrainConfig


def main(cfg: PretrainConfig) -> dict:
    tok = setup.tokenizer(cfg.tokenizer)
    model = setup.from_config(cfg, tok)
    setup.apply_patch(model, cfg)
    train_seqs, eval_seqs = data.packed(cfg, tok)
    return loop.train(cfg, model, tok, train_seqs, eval_seqs)


if __name__ == "__main__":
    sys.exit(cli.run("pretrain", main))
