"""`python -m dflash_ops.demo prepare <dir>`: the demo's tiny target, tokenizer and data
(`dflash_ops.data.demo`)."""

import sys

from dflash_ops.data.demo import main

if __name__ == "__main__":
    sys.exit(main())
