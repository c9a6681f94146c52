"""`python -m dflash_ops.train --config <yaml>`: train a drafter (one process, or the pipeline through
torchrun) (`dflash_ops.run.main`)."""

import sys

from dflash_ops.run.main import cli

if __name__ == "__main__":
    sys.exit(cli())
