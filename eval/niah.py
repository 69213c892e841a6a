"""Needle-in-a-haystack depth x length heatmap for a list of patch specs: the same as `hfpatch eval niah`.

    python eval/niah.py --text-files ../shared/data/books --lengths 2k,4k,8k,16k --patches none,yarn:2 --out runs/niah

The code lives in hfpatch.evaluate.niah (so that an installed hfpatch runs it too); see --help.
"""

import sys

from hfpatch.evaluate.niah import main

if __name__ == "__main__":
    sys.exit(main())
