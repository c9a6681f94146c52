"""`python -m dflash_ops.plots RUN [RUN ...] --out DIR`: loss and tau curves of runs as PNG
(`dflash_ops.training.plots`)."""

import sys

from dflash_ops.training.plots import main

if __name__ == "__main__":
    sys.exit(main())
