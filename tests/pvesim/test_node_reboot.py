"""pvesim's node reboot: pve-guests.service's stopall (every running container, by descending startup
order) then startall (those with `onboot: 1`, by ascending order); a container's init starts the systemd
services enabled in the container itself, as its systemd would at boot, and none of the machine's."""

import pytest

from tests.waiting import wait_for

pytestmark = [pytest.mark.sim]

PROBE_UNIT = """[Unit]
Description=probe
[Service]
Type=simple
Environment=WORD=booted
ExecStart=/bin/sh -c 'echo $WORD > /var/lib/probe'
[Install]
WantedBy=multi-user.target
"""


def test_a_reboot_stops_every_container_and_starts_those_with_onboot_in_order(sim_factory):
    sim = sim_factory(nodes=1, containers=(300, 301, 302), gpus=0)

    def node(command):
        res = sim.ssh("pve1", command)
        assert res.returncode == 0, f"{command}: {res.stderr}"
        return res.stdout

    node("pct set 300 --onboot 1 --startup order=2 && pct set 301 --onboot 1 --startup order=1,up=1")
    bad = sim.ssh("pve1", "pct set 302 --startup sometime")
    assert bad.returncode == 255 and "startup: invalid format - value 'sometime'" in bad.stderr
    node("pct exec 300 -- sh -c 'cat > /etc/systemd/system/probe.service && "
         "ln -sf ../probe.service /etc/systemd/system/multi-user.target.wants/probe.service' <<'EOF'\n"
         f"{PROBE_UNIT}EOF")
    before = {vmid: node(f"pct exec {vmid} -- cat /proc/1/stat").split()[21] for vmid in (300, 301, 302)}

    log = sim.reboot_node("pve1")

    stops = [line.split()[2] for line in log.splitlines() if line.startswith("Stopping CT")]
    starts = [line.split()[2] for line in log.splitlines() if line.startswith("Starting CT")]
    assert stops == ["302", "300", "301"] and starts == ["301", "300"], log
    assert node("pct status 302") == "status: stopped\n"
    for vmid in (300, 301):
        assert node(f"pct status {vmid}") == "status: running\n"
        assert node(f"pct exec {vmid} -- cat /proc/1/stat").split()[21] != before[vmid]  # a new init
    # The unit enabled in CT 300 ran at its boot, with its environment; nothing else was started.
    assert wait_for(lambda: sim.ssh("pve1", "pct exec 300 -- cat /var/lib/probe").stdout == "booted\n", 10)
    assert node("pct exec 300 -- ls /run/pvesim-journal").split() == ["probe.service.log"]
    assert sim.ssh("pve1", "pct exec 301 -- ls /run/pvesim-journal").stdout.split() == []
