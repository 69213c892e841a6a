"""Train a small model from scratch with any hfpatch spec, to compare position / norm schemes on equal terms.

    accelerate launch recipes/pretrain.py --config recipes/configs/pretrain_tiny_llama.yaml [key=value ...]

The model is built from `model_config` (a transformers config: model_type and sizes; the vocabulary comes from the
tokenizer), patched with `patch` before training, and saved with hfpatch.save_pretrained to output_dir/final.
"""

import sys

from huggingface_hub.errors import StrictDataclassError
from transformers import AutoConfig, AutoModelForCausalLM

from hfpatch.train import cli, data, loop, setup


def main(cfg):
    tok = setup.tokenizer(cfg.tokenizer)
    options = dict(cfg.model_config)
    options.setdefault("vocab_size", len(tok))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        options.setdefault(key, getattr(tok, key))
    try:
        config = AutoConfig.for_model(options.pop("model_type"), **options)
    except (ValueError, TypeError, StrictDataclassError) as e:  # the last: sizes that do not fit together
        raise cli.ConfigError(f"model_config: {' '.join(str(e).split())}") from None
    model = AutoModelForCausalLM.from_config(config, dtype=setup.dtype_of(cfg))
    setup.check_causal(model)
    setup.apply_patch(model, cfg)
    train_seqs, eval_seqs = data.packed(cfg, tok)
    return loop.train(cfg, model, tok, train_seqs, eval_seqs)


if __name__ == "__main__":
    sys.exit(cli.run("pretrain", main))
