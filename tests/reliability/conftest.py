"""The reliability suite: faults, bad input and load against pvesim.

`make test` runs each test with its fast trial count; `make test-reliability` sets
DFLASH_RELIABILITY_FULL=1 and runs the full counts docs/RELIABILITY.md reports (at least 50 decoy trials,
20 killed deploys, ...). Tests marked `reliability_full`, here or elsewhere, run only then
(tests/conftest.py skips them otherwise). Every test here is marked `reliability`: `make
test-reliability` selects `reliability or reliability_full`.
"""

from pathlib import Path

import pytest

from pvesim.fleet import Fleet
from tests.reliability.slice_cases import SLICE
from tests.reliability.stops_support import CONTAINERS


@pytest.hookimpl(tryfirst=True)  # before tests/conftest.py's, which reads the markers to skip
def pytest_collection_modifyitems(config, items):
    here = Path(__file__).resolve().parent
    collected = set()
    for item in items:
        path = Path(str(item.fspath)).resolve()
        if here in path.parents:
            item.add_marker(pytest.mark.reliability)
            case = item.nodeid.split("::", 1)[-1]
            collected.add((path.name, case))
            if SLICE.get(path.name) == case:
                item.add_marker(pytest.mark.reliability_slice)
    if "reliability_slice" in (config.getoption("markexpr") or ""):
        files = {p.name for p in here.glob("test_*.py")}
        unlisted = sorted(files - set(SLICE))
        missing = sorted(f"{name}::{case}" for name, case in SLICE.items() if (name, case) not in collected)
        if unlisted or missing:
            raise pytest.UsageError(
                "the reliability slice (tests/reliability/slice_cases.py) must name one collected case of "
                f"every file of the suite: files without a case: {unlisted or 'none'}; cases not collected: "
                f"{missing or 'none'}")


@pytest.fixture(scope="session")
def fleet(tmp_path_factory):
    """The stop tests' fleet: one node with CT 200-203, the release deployed and a run live in each.

    Bringing a fleet up and deploying to it is most of the cost of these tests, so the modules that
    take this fixture share one per pytest process (per xdist worker). Each test starts by putting
    the containers it uses into the state it needs (runs live or stopped). A module that needs
    another fleet defines its own `fleet` fixture, which takes precedence over this one."""
    # Four GPUs per container (the run's two, a second run's one, one spare): 16 on the node.
    shared = Fleet(tmp_path_factory.mktemp("stops-fleet"), nodes=1, containers=CONTAINERS,
                   gpus=4 * len(CONTAINERS))
    try:
        res = shared.play("deploy.yml", "-e", f"dflash_fleet_serial={len(CONTAINERS)}", timeout=1800)
        if res.rc != 0:
            pytest.fail(f"the stop tests' fleet did not deploy: {res}")
        yield shared
    finally:
        shared.down()
