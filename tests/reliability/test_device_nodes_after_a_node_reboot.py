"""A node's reboot where nothing makes the NVIDIA device nodes at boot (pvesim's boot makes none, as a
real one: NVIDIA's driver README). Without the node's unit the onboot start of the container fails in
PVE's words ("Device /dev/nvidia0 does not exist") and the product's start of it says the same; with the
unit (provision.yml's node play, ordered Before=pve-guests.service), which makes every file the container
passes through, the run comes back from its checkpoint at the next reboot, as in
test_runs_after_a_node_reboot.py.

pve1 with CT 200 (eight GPUs), `onboot: 1`, a run deployed in it."""

import pytest

from tests.reliability.input_support import deployed_fleet
from tests.reliability.test_runs_after_a_node_reboot import BOOT_DEVICES, booted_run, resumed_after

pytestmark = [pytest.mark.sim, pytest.mark.slow, pytest.mark.reliability_full]

MISSING = "Device /dev/nvidia0 does not exist"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    for fleet in deployed_fleet(tmp_path_factory.mktemp("device-nodes"), nodes=1, containers=(200,)):
        fleet.node_sh(200, "pct set 200 --onboot 1")
        yield fleet


def test_without_the_boot_unit_the_container_does_not_start_and_with_it_the_run_resumes(fleet):
    assert fleet.play("deploy.yml").rc == 0
    before = fleet.run_info(200)
    fleet.wait_for_checkpoint(200)

    log = fleet.sim.reboot_node("pve1")
    assert MISSING in log, log
    assert fleet.node_sh(200, "pct status 200") == "status: stopped\n"
    # The product's node check, allowed to start the container, says pct's words.
    res = fleet.play("deploy.yml", "-e", "proxmox_host_start_containers=true")
    assert res.rc != 0 and MISSING in str(list(res.host_results())), list(res.host_results())

    # The unit makes every file CT 200 passes through (nvidia-modprobe makes only the files of its options:
    # /dev/nvidia0 and /dev/nvidiactl need -c0 and -c255 without -u).
    assert fleet.play(str(BOOT_DEVICES)).rc == 0
    log = fleet.sim.reboot_node("pve1")
    assert "does not exist" not in log, log
    assert fleet.node_sh(200, "pct status 200") == "status: running\n"
    record = booted_run(fleet, 200, before)
    saved, resumed, first = resumed_after(fleet, 200, record["pid"])
    assert resumed == saved and first == saved + 1, (saved, resumed, first)
