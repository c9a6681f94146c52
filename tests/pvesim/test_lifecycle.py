"""up is idempotent, down leaves nothing behind (also after a crash), sims run side by side."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import pvesim
from pvesim import container, host, node, procs
from pvesim import sim as sim_module

pytestmark = pytest.mark.sim


def started_pids(s):
    """(pid, start time) of everything the sim runs: each node's sshd, each container's init and monitor."""
    pids = []
    for n in s.nodes:
        pids.append((n.sshd_pid, n.sshd_started))
        files = node.NodeFiles(s.state_dir, n.name)
        for vmid in n.containers:
            init = container.init_pid(files, vmid)
            monitor = int(open(f"/proc/{init}/stat").read().rpartition(")")[2].split()[1])
            pids += [(init, procs.start_time(init)), (monitor, procs.start_time(monitor))]
    return pids


def test_up_twice_is_a_no_op(sim_factory):
    first = sim_factory(nodes=1, containers=(310, 311), gpus=2)
    before = started_pids(first)
    state = (first.state_dir / "sim.json").read_text()
    again = pvesim.up(nodes=1, containers=(310, 311), gpus=2, state_dir=first.state_dir,
                      inventory=first.inventory_path)
    assert started_pids(again) == before
    assert (first.state_dir / "sim.json").read_text() == state
    with pytest.raises(pvesim.SimError, match="another layout"):
        pvesim.up(nodes=1, containers=(310,), gpus=2, state_dir=first.state_dir,
                  inventory=first.inventory_path)


def test_up_restarts_a_stopped_container(sim_factory):
    s = sim_factory(nodes=1, containers=(320,), gpus=1)
    assert s.ssh("pve1", "pct stop 320").returncode == 0
    pvesim.up(nodes=1, containers=(320,), gpus=1, state_dir=s.state_dir, inventory=s.inventory_path)
    assert s.ssh("pve1", "pct status 320").stdout == "status: running\n"


def test_down_leaves_no_process_container_or_file(sim, tmp_path):
    s = pvesim.up(nodes=2, containers=(330, 331), gpus=1, state_dir=tmp_path / "state",
                  inventory=tmp_path / "hosts.yml")
    pids = started_pids(s)
    # A session left open on a node (like Ansible's ControlPersist) must not outlive down either.
    session = subprocess.Popen([*s.ssh_argv("pve1"), "sleep 600"], stdin=subprocess.DEVNULL)
    try:
        assert all(procs.is_alive(p, st) for p, st in pids)
        pvesim.down(s.state_dir)
        assert [p for p, st in pids if procs.is_alive(p, st)] == []
        assert session.wait(timeout=10) != 0
    finally:
        session.kill()
    assert not s.state_dir.exists() and not s.inventory_path.exists()
    assert str(s.state_dir) not in host.SYSTEM_KNOWN_HOSTS.read_text()
    assert not list(d / f"pvesim-{s.tag}" for d in host.Path("/sys/fs/cgroup").iterdir()
                     if (d / f"pvesim-{s.tag}").exists())
    # The session sim is still up, so the shared pct stays installed and keeps working.
    assert host.PCT_PATH.exists()
    assert sim.ssh("pve1", "pct status 200").stdout == "status: running\n"


def test_down_cleans_up_after_an_up_that_crashed_half_way(tmp_path, monkeypatch):
    def crash(*args):
        raise KeyboardInterrupt("killed half-way")

    # The first node's sshd runs when writing the second node's containers fails, and the process
    # "dies" before its own cleanup: only what the state dir recorded is left to find.
    monkeypatch.setattr(sim_module, "_down_locked", lambda state_dir: None)
    real_write = container.write_container

    def write_or_crash(files, tag, vmid, *layout):
        return crash() if vmid == 341 else real_write(files, tag, vmid, *layout)

    monkeypatch.setattr(container, "write_container", write_or_crash)
    with pytest.raises(KeyboardInterrupt):
        pvesim.up(nodes=2, containers=(340, 341), gpus=1, state_dir=tmp_path / "state",
                  inventory=tmp_path / "hosts.yml")
    monkeypatch.undo()
    recorded = json.loads((tmp_path / "state" / "sim.json").read_text())
    sshd = [(n["sshd_pid"], n["sshd_started"]) for n in recorded["nodes"] if n["sshd_pid"]]
    assert sshd and all(procs.is_alive(p, st) for p, st in sshd)

    pvesim.down(tmp_path / "state")

    assert not any(procs.is_alive(p, st) for p, st in sshd)
    assert not (tmp_path / "state").exists()


def test_down_works_even_when_the_state_dir_was_deleted(tmp_path):
    s = pvesim.up(nodes=1, containers=(350,), gpus=1, state_dir=tmp_path / "state",
                  inventory=tmp_path / "hosts.yml")
    pids = started_pids(s)
    shutil.rmtree(s.state_dir)  # e.g. an old pytest temp dir cleaned up under a running sim

    pvesim.down(s.state_dir)

    assert [p for p, st in pids if procs.is_alive(p, st)] == []
    assert s.state_dir not in host.registered_state_dirs()


def test_down_all_brings_down_every_registered_sim(tmp_path, monkeypatch):
    # A private registry, pct and default state dir: the other sims of this machine stay up and keep
    # their /usr/sbin/pct.
    monkeypatch.setattr(host, "REGISTRY", tmp_path / "registry")
    monkeypatch.setattr(host, "PCT_PATH", tmp_path / "pct")
    monkeypatch.setattr(host, "PACKAGE_PCT", tmp_path / "packages")
    monkeypatch.setattr(sim_module, "DEFAULT_STATE_DIR", tmp_path / "default")
    sims = [pvesim.up(nodes=1, containers=(360 + i,), gpus=1, state_dir=tmp_path / f"s{i}",
                      inventory=tmp_path / f"hosts{i}.yml") for i in range(2)]
    pids = [p for s in sims for p in started_pids(s)]

    pvesim.down_all()

    assert [p for p, st in pids if procs.is_alive(p, st)] == []
    assert host.registered_state_dirs() == []
    assert not (tmp_path / "pct").exists()  # the last sim down removes the shared pct


def test_down_of_a_checkout_leaves_another_checkout_s_sims_up(tmp_path, monkeypatch):
    """`pvesim down --checkout` (.ci/run's last step) brings down the sims this checkout's pvesim brought
    up, whatever their state dirs, and leaves a sim of another checkout on the machine running."""
    monkeypatch.setattr(host, "REGISTRY", tmp_path / "registry")
    monkeypatch.setattr(host, "PCT_PATH", tmp_path / "pct")
    monkeypatch.setattr(host, "PACKAGE_PCT", tmp_path / "packages")
    monkeypatch.setattr(sim_module, "DEFAULT_STATE_DIR", tmp_path / "default")
    ours, theirs = [pvesim.up(nodes=1, containers=(370 + i,), gpus=1, state_dir=tmp_path / f"s{i}",
                              inventory=tmp_path / f"hosts{i}.yml") for i in range(2)]
    provision = theirs.state_dir / "nodes" / "pve1" / "provision.json"
    record = json.loads(provision.read_text())
    provision.write_text(json.dumps({**record, "path": "/srv/another-checkout"}))
    try:
        ours_pids, theirs_pids = started_pids(ours), started_pids(theirs)
        pvesim.down_all(checkout_only=True)
        assert [p for p, st in ours_pids if procs.is_alive(p, st)] == []
        assert all(procs.is_alive(p, st) for p, st in theirs_pids)
        assert host.registered_state_dirs() == [theirs.state_dir.resolve()]
    finally:
        pvesim.down(theirs.state_dir)


def test_each_checkout_has_a_default_state_dir_of_its_own(tmp_path):
    """`make sim-up` / `make sim-down` in two clones on one machine: two simulations, neither ends the
    other's (pvesim's default state dir is named after the checkout and a hash of its path)."""
    defaults = []
    for clone in ("one/dflash-ops", "two/dflash-ops"):
        shutil.copytree(Path(pvesim.__file__).parent, tmp_path / clone / "pvesim",
                        ignore=shutil.ignore_patterns("__pycache__"))
        probe = subprocess.run([sys.executable, "-c", "import pvesim; print(pvesim.DEFAULT_STATE_DIR)"],
                               cwd=tmp_path / clone, capture_output=True, text=True, timeout=60, check=True)
        defaults.append(Path(probe.stdout.strip()))
    assert defaults[0] != defaults[1], defaults
    assert all(d.parent == Path("/var/lib/pvesim") and d.name.startswith("dflash-ops-") for d in defaults)


def test_cli_help_errors_and_status(sim):
    run = [sys.executable, "-m", "pvesim"]
    assert subprocess.run([*run, "--help"], capture_output=True).returncode == 0
    for bad, message in ((["up", "--containers", "abc"], "expected container ids"),
                         (["up", "--gpus", "99", "--state-dir", "/tmp/pvesim-never"], "--gpus must be"),
                         (["up", "--containers", "5", "--state-dir", "/tmp/pvesim-never"], "from 100 to"),
                         (["status", "--state-dir", "/tmp/pvesim-never"], "no pvesim is up")):
        res = subprocess.run([*run, *bad], capture_output=True, text=True, cwd=sim_module.REPO_ROOT)
        assert res.returncode == 2, (bad, res.stderr)
        assert message in res.stderr and "Traceback" not in res.stderr
    out = subprocess.run([*run, "status", "--state-dir", str(sim.state_dir)], capture_output=True,
                         text=True).stdout
    assert f"pve2   {sim.node('pve2').address}:{sim.node('pve2').port}" in out
    assert "CT 203      running" in out
