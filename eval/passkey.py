"""Passkey retrieval by length x depth for a list of patch specs: the same as `hfpatch eval passkey`.

    python eval/passkey.py --lengths 1k,2k,4k,8k --depths 0,0.5,1 --trials 2 --patches none,yarn:2

The code lives in hfpatch.evaluate.passkey (so that an installed hfpatch runs it too); see --help.
"""

import sys

from hfpatch.evaluate.passkey import main

if __name__ == "__main__":
    sys.exit(main())
