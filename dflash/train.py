"""`python -m dflash.train --config <yaml>`: train a drafter (one process, or the pipeline through torchrun)
(`dflash.run.main`)."""

import sys

from dflash.run.main import main

if __name__ == "__main__":
    sys.exit(main())
