"""The whole playbook suite of tests/roles/test_playbooks.py again, on nodes whose driver lists in a
container only the container's own processes with its own pids (pvesim's compute_apps="container",
newer NVIDIA drivers). `make test` runs the suite once under the older drivers' behaviour (every
process with its host pid) and tests/roles/test_strict_node.py one cycle under this one; the whole
suite under it runs in the full reliability suite only (make test-reliability)."""

import importlib.util
from pathlib import Path

import pytest

from pvesim.fleet import Fleet

SUITE = Path(__file__).resolve().parents[1] / "roles" / "test_playbooks.py"
_spec = importlib.util.spec_from_file_location("playbook_suite", SUITE)
suite = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(suite)

pytestmark = [pytest.mark.sim, pytest.mark.slow, pytest.mark.reliability_full]

# The suite's tests, in their order, collected here with this module's fleet.
globals().update({name: getattr(suite, name) for name in vars(suite) if name.startswith("test_")})


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("roles-fleet-container-driver"), nodes=2, containers=suite.CONTAINERS,
              compute_apps="container")
    yield f
    f.down()
