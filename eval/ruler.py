"""The synthetic RULER tasks by length for a list of patch specs: the same as `hfpatch eval ruler`.

    python eval/ruler.py --tasks niah_single_1,niah_single_2,vt --lengths 2k,4k,8k,16k --samples 5 \
        --patches none,yarn:2,dynamic --text-files ../shared/data/books --out runs/ruler

The code lives in hfpatch.evaluate.ruler (so that an installed hfpatch runs it too); see --help.
"""

import sys

from hfpatch.evaluate.ruler import main

if __name__ == "__main__":
    sys.exit(main())
