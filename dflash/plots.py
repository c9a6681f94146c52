"""`python -m dflash.plots RUN [RUN ...] --out DIR`: loss and tau curves of runs as PNG
(`dflash.training.plots`)."""

import sys

from dflash.training.plots import main

if __name__ == "__main__":
    sys.exit(main())
