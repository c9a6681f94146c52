"""`python -m dflash.demo prepare <dir>`: the demo's tiny target, tokenizer and data (`dflash.data.demo`)."""

import sys

from dflash.data.demo import main

if __name__ == "__main__":
    sys.exit(main())
