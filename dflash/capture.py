"""`python -m dflash.capture --config <yaml> [--out DIR]`: capture the target's features into a feature cache
(`dflash.data.capture`)."""

import sys

from dflash.data.capture import main

if __name__ == "__main__":
    sys.exit(main())
