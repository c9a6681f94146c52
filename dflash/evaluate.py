"""`python -m dflash.evaluate --config <yaml> --checkpoint <dir>`: a drafter's acceptance length against its
target (`dflash.serve.evaluate`)."""

import sys

from dflash.serve.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
