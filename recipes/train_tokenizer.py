"""Train a small byte-level BPE tokenizer for a from-scratch model (the `tokenizer:` of recipes/pretrain.py).

    python recipes/train_tokenizer.py --text-files ../shared/data/books/emma.txt ... --vocab-size 2048 --out DIR

Why: a tiny model with SmolLM2's 49,152-token vocabulary spends most of its compute in the LM head (256 x 49,152
multiply-adds per token against about 3M for four 256-wide blocks), so on a CPU it sees few tokens per minute and
stays near unigram statistics. A vocabulary of a few thousand pieces makes every step about four times cheaper.
Byte-level, so every text is encodable; EOS is added between documents by the recipes' packing.
"""

import argparse
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from hfpatch.lm.text import documents


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--text-files", nargs="+", help="files or folders of .txt (default: the default corpus)")
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.vocab_size < 256 + 3:
        p.error(f"--vocab-size must be at least 259 (256 bytes + 3 special tokens), got {args.vocab_size}")
    docs = list(documents(args.text_files))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((d.text for d in docs), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(args.out)
    print(f"{len(fast)} tokens, trained on {len(docs)} document(s): {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
