"""The example model card of the docs: a tiny model patched with yarn:2 and saved by hfpatch.save_pretrained, a small
perplexity run of it, and `hfpatch card` putting the run in the card.

    python -m eval.card_example          # writes eval/results/card_example/

Writes eval/results/card_example/README.md (the card as hfpatch.save_pretrained wrote it) and
eval/results/card_example/ppl/ (the run: results.json, table.md, ppl.png). eval/docs_tables.py renders the card with
the run added by the `hfpatch card` code (docs/generated/model_card_example.md), so a change to either shows as a
stale generated file.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

import hfpatch
from eval.cross_engine import BOOKS
from hfpatch import tiny
from hfpatch.evaluate import evaluation

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "card_example"
BOOK = BOOKS / "moby_dick.txt"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--book", type=Path, default=BOOK, help=f"the text the run reads (default {BOOK})")
    args = p.parse_args(argv)
    if not args.book.is_file():
        p.error(f"no such file: {args.book} (the books are in ../shared/data/books/; --book names another text)")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "tiny-llama-yarn2"
        model = hfpatch.patch(tiny.sized_model("llama"), position="yarn", factor=2.0)
        hfpatch.save_pretrained(model, folder, tokenizer=tiny.char_tokenizer())
        run = Path(tmp) / "ppl"
        here = os.getcwd()
        os.chdir(tmp)  # the run names the model as given: the folder's name, not this machine's temporary path
        try:
            rc = evaluation("ppl").main(["--model", folder.name, "--lengths", "64,128,256", "--patches",
                                         "none,ntk:4", "--text-files", str(args.book), "--tokens-per-doc", "512",
                                         "--out", str(run)])
        finally:
            os.chdir(here)
        if rc:
            return rc
        shutil.rmtree(OUT, ignore_errors=True)
        (OUT / "ppl").mkdir(parents=True)
        shutil.copyfile(folder / "README.md", OUT / "README.md")
        for name in ("results.json", "table.md", "ppl.png"):
            shutil.copyfile(run / name, OUT / "ppl" / name)
    print(f"wrote {OUT}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
