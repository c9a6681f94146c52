"""`python -m dflash.export --checkpoint <dir> --out <dir>`: export a trained drafter for serving engines
(`dflash.serve.export`)."""

import sys

from dflash.serve.export import main

if __name__ == "__main__":
    sys.exit(main())
