"""`python -m dflash_ops.evaluate --config <yaml> --checkpoint <dir>`: a drafter's acceptance length against
its target (`dflash_ops.serve.evaluate`)."""

import sys

from dflash_ops.serve.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
