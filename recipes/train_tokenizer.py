"""Train a small byte-level BPE tokenizer for a from-scratch model (the `tokenizer:` of recipes/pretrain.py).

    python recipes/train_tokenizer.py --text-files ../shared/data/books/emma.txt ... --vocab-size 2048 --out DIR

Why a small vocabulary, and how it is trained: hfpatch/train/tokenizer.py.
"""

import argparse
import sys

from hfpatch.train.tokenizer import SMALLEST, train_tokenizer


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--text-files", nargs="+", help="files or folders of .txt (default: the default corpus)")
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.vocab_size < SMALLEST:
        p.error(f"--vocab-size must be at least {SMALLEST} (256 bytes + 3 special tokens), got {args.vocab_size}")
    train_tokenizer(args.text_files, args.vocab_size, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
