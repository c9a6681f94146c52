"""The reliability suite: faults, bad input and load against pvesim.

`make test` runs each test with its fast trial count; `make test-reliability` sets
DFLASH_RELIABILITY_FULL=1 and runs the full counts the README reports (at least 50 decoy trials,
20 killed deploys, ...). Tests marked `reliability_full` run only then.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # trial_counts and the *_support modules

from trial_counts import FULL  # noqa: E402


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).resolve().parent
    skip_full = pytest.mark.skip(reason="full reliability suite only (make test-reliability)")
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.reliability)
            if not FULL and item.get_closest_marker("reliability_full"):
                item.add_marker(skip_full)
