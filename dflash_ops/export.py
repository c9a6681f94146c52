"""`python -m dflash_ops.export --checkpoint <dir> --out <dir>`: export a trained drafter for serving engines
(`dflash_ops.serve.export`)."""

import sys

from dflash_ops.serve.export import main

if __name__ == "__main__":
    sys.exit(main())
