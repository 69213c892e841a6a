"""Perplexity at extended lengths for a list of patch specs: the same as `hfpatch eval ppl`.

    python eval/perplexity.py       # SmolLM2-135M, stdlib corpus, none vs yarn:2 at 2k, 8k, 16k
    python eval/perplexity.py --text-files ../shared/data/books --lengths 4k,8k,16k \
        --patches none,linear:2,ntk:2,yarn:2,dynamic --max-docs 2 --out runs/books

The code lives in hfpatch.evaluate.perplexity (so that an installed hfpatch runs it too); see --help.
"""

import sys

from hfpatch.evaluate.perplexity import main

if __name__ == "__main__":
    sys.exit(main())
