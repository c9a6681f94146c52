"""The reliability suite: faults, bad input and load against pvesim.

`make test` runs each test with its fast trial count; `make test-reliability` sets
DFLASH_RELIABILITY_FULL=1 and runs the full counts docs/RELIABILITY.md reports (at least 50 decoy trials,
20 killed deploys, ...). Tests marked `reliability_full`, here or elsewhere, run only then
(tests/conftest.py skips them otherwise). Every test here is marked `reliability`: `make
test-reliability` selects `reliability or reliability_full`.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # trial_counts and the *_support modules


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.reliability)
