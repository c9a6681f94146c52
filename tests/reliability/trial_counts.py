"""How many randomised trials a reliability test runs: the fast count under `make test`, the full
count under `make test-reliability` (DFLASH_RELIABILITY_FULL=1). A module of its own name, because
`from conftest import ...` gets whichever conftest pytest loaded last."""

import os

FULL = os.environ.get("DFLASH_RELIABILITY_FULL") == "1"


def trials(fast, full):
    """`full` under make test-reliability, else `fast`."""
    return full if FULL else fast
