"""The connection test suites of ansible-core and community.proxmox, run as their projects release them,
against a pvesim container through dflash.ops.pct_pipelined, with and without pipelining; the release lines
they run on are the ones the collection declares; the quoting fix prepared for community.proxmox passes its
own unit suite.

Where they come from (`make peer-suites`, scripts/peer_suites.py, at the versions of the Ansible under test:
the venv's ansible-core 2.19 and community.proxmox 1.4.0, or under `make test-newest` 2.20 and 1.6.0, then
2.21 and 2.0.0, pvesim.fleet.ANSIBLE_BIN):
- ansible-core's `test/integration/targets/connection` (test_connection.yml: raw with unicode,
  copy and fetch of `汉语-['foo bar'].txt` with a checksum, wait_for_connection; no connection vars in
  the output; both reset_connection playbooks), from its sdist;
- community.proxmox's `connection_proxmox_pct_remote` (its copy of the connection target through
  `connection_posix/test.sh`, then plugin-specific-tests.yml), from the sdist of the `ansible` package.

What is ours is the inventory alone: the suite's own group of two hosts (pipelining on and off) pointing at
a sim container. community.proxmox's runme.sh first runs dependencies.yml, which installs a mock pct over
/usr/sbin/pct on the controller (and paramiko); pvesim's real pct and the venv's paramiko take its place,
so that step is left out, and the directory its mock pct creates for each container
(`/tmp/ansible-remote/...`) is made in the container, as the mock would have.
"""

import json
import os
import re
import shutil
import subprocess
import tomllib

import pytest
import yaml
from ansible.galaxy.dependency_resolution.versioning import meets_requirements
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from pvesim.fleet import ANSIBLE_BIN, REPO, VENV_BIN, ansible_env
from scripts.newest_venv import LINES
from scripts.peer_suites import COMMUNITY_PROXMOX, DEFAULT_DIR, suite_dir

COLLECTION = REPO / "ansible_collections" / "dflash" / "ops"
# The changes prepared for community.proxmox (docs/CONNECTION.md): the quoting fix, and the translation of a
# failure to connect that 2.0 lost. Made against its source at 2.0.0 (its connection and unit suite are those
# of main when they were made).
PATCHES = sorted((REPO / "docs" / "patches").glob("community.proxmox-*.patch"))
PATCH_BASE = "2.0.0"
UNIT_SUITE = "tests/unit/plugins/connection/test_proxmox_pct_remote.py"

ANSIBLE_CORE_TARGET = "test/integration/targets/connection"
PROXMOX_TARGETS = "ansible_collections/community/proxmox/tests/integration/targets"
# The arguments connection_posix/test.sh (community.proxmox's runner of a connection target) passes.
SUITE_ARGS = ["-e", "action_prefix=", "-e", "local_tmp=/tmp/ansible-local",
              "-e", "remote_tmp=/tmp/ansible-remote"]


def peer_suite(dist, path):
    found = suite_dir(DEFAULT_DIR, dist) / path
    if not (suite_dir(DEFAULT_DIR, dist) / ".complete").exists():
        pytest.fail(f"the peer suites are not unpacked ({found}): run `make peer-suites`", pytrace=False)
    return found


def inventory(group, sim, vmid):
    """The suite's inventory, adapted: its group, its two hosts, and the container's connection."""
    hv = {key: value for key, value in sim_hostvars(sim, vmid).items() if not key.startswith("pvesim_")}
    lines = [f"[{group}]", f"{group}-pipelining ansible_pipelining=true",
             f"{group}-no-pipelining ansible_pipelining=false", f"[{group}:vars]"]
    return "\n".join(lines + [f"{key}={value}" for key, value in hv.items()]) + "\n"


def sim_hostvars(sim, vmid):
    from pvesim.sim import container_hostvars
    return container_hostvars(sim, sim.node_of(vmid).name, vmid)


def installed(bin_dir):
    """(ansible-core version, community.proxmox version, Python X.Y) of the Ansible in `bin_dir`."""
    code = ("import importlib.metadata as m, json, pathlib, sys\n"
            "import ansible_collections.community.proxmox as cp\n"
            "manifest = json.loads(pathlib.Path(cp.__path__[0], 'MANIFEST.json').read_text())\n"
            "json.dump([m.version('ansible-core'), manifest['collection_info']['version'],"
            " '%d.%d' % sys.version_info[:2]], sys.stdout)")
    res = subprocess.run([str(bin_dir / "python"), "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return tuple(json.loads(res.stdout))


def run(argv, cwd, **env):
    res = subprocess.run(argv, cwd=cwd, env=ansible_env(**env), capture_output=True, text=True, timeout=600,
                         stdin=subprocess.DEVNULL)
    assert res.returncode == 0, \
        f"{' '.join(argv)} in {cwd} exited {res.returncode}\n{res.stdout[-6000:]}\n{res.stderr[-3000:]}"
    return res.stdout


def assert_hosts_ran(group, out, tasks):
    """Both hosts of the suite's group ran its tasks (the recaps' ok counts add up), none failed."""
    for host in (f"{group}-pipelining", f"{group}-no-pipelining"):
        recaps = re.findall(rf"^{host}\s*: ok=(\d+) .*failed=(\d+)", out, re.M)
        assert recaps and sum(int(ok) for ok, _ in recaps) >= tasks and not any(int(f) for _, f in recaps), \
            (host, recaps, out[-3000:])


def ansible_core_suite(sim, vmid, tmp_path):
    target = tmp_path / "connection"
    shutil.copytree(peer_suite("ansible-core", ANSIBLE_CORE_TARGET), target)
    (tmp_path / "test_connection.inventory").write_text(inventory("pct_pipelined", sim, vmid))
    out = run(["bash", "./test.sh", "-e", "target_hosts=pct_pipelined", *SUITE_ARGS], target,
              INVENTORY=str(tmp_path / "test_connection.inventory"))
    assert "SUCCESS: Connection vars not found" in out
    assert_hosts_ran("pct_pipelined", out, tasks=11)


def community_proxmox_suite(sim, vmid, tmp_path):
    targets = tmp_path / "targets"
    shutil.copytree(peer_suite("ansible", PROXMOX_TARGETS), targets)
    here = targets / "connection_proxmox_pct_remote"
    (here / "test_connection.inventory").write_text(inventory("proxmox_pct_remote", sim, vmid))
    node = sim.node_of(vmid).name
    mock_dir = f"/tmp/ansible-remote/proxmox_pct_remote/integration_test/ct_{vmid}"
    made = sim.ssh(node, f"pct exec {vmid} -- mkdir -p {mock_dir}")
    assert made.returncode == 0, made.stderr
    # runme.sh, less its dependencies.yml (see the module docstring)
    out = run(["bash", "./test.sh"], here)
    out += run(["ansible-playbook", "plugin-specific-tests.yml", "-i", "./test_connection.inventory",
                "-e", "target_hosts=proxmox_pct_remote", *SUITE_ARGS], here)
    assert_hosts_ran("proxmox_pct_remote", out, tasks=11 + 4)


SUITES = {"ansible-core": ansible_core_suite, "community.proxmox": community_proxmox_suite}


@pytest.mark.sim
@pytest.mark.reliability
@pytest.mark.parametrize("suite", SUITES)
def test_the_peer_suites_pass_as_root(suite, sim, tmp_path):
    SUITES[suite](sim, 201, tmp_path)


@pytest.mark.sim
@pytest.mark.reliability_full
@pytest.mark.parametrize("suite", SUITES)
def test_the_peer_suites_pass_through_sudo(suite, sudo_sim, tmp_path):
    SUITES[suite](sudo_sim, 390, tmp_path)


def release_lines():
    """(ansible-core, community.proxmox) of every venv the suites run on: this venv's (make test) and
    those of scripts/newest_venv.py (make test-newest)."""
    core, proxmox, _ = installed(VENV_BIN)
    return [(".".join(core.split(".")[:2]), proxmox)] + [
        (line["ansible_core"], line["community_proxmox"]) for line in LINES.values()]


def next_minor(version):
    major, minor = Version(version).release[:2]
    return f"{major}.{minor + 1}.0"


def test_the_declared_ranges_are_the_tested_release_lines():
    """requires_ansible, the controller extra and the execution environment admit each tested ansible-core
    line and no other; galaxy.yml's (and requirements.yml's) community.proxmox range each tested release,
    from the oldest up to the next minor after the newest."""
    lines = release_lines()
    cores = sorted({core for core, _ in lines}, key=Version)
    proxmoxes = sorted({proxmox for _, proxmox in lines}, key=Version)
    runtime = yaml.safe_load((COLLECTION / "meta" / "runtime.yml").read_text())
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extra = project["optional-dependencies"]["controller"]
    (controller,) = [r.removeprefix("ansible-core") for r in extra if r.startswith("ansible-core")]
    ee = yaml.safe_load((REPO / "execution-environment.yml").read_text())["dependencies"]["ansible_core"]
    for name, spec in (("requires_ansible", runtime["requires_ansible"]), ("[controller]", controller),
                       ("execution-environment.yml", ee["package_pip"].removeprefix("ansible-core"))):
        specifiers = SpecifierSet(spec)
        admitted = [f"{core}.{patch}" for core in cores for patch in (0, 99)]
        refused = [f"{Version(cores[0]).major}.{Version(cores[0]).minor - 1}.99", next_minor(cores[-1])]
        assert all(v in specifiers for v in admitted) and not any(v in specifiers for v in refused), (
            name, spec, cores)
    pin = yaml.safe_load((COLLECTION / "galaxy.yml").read_text())["dependencies"]["community.proxmox"]
    assert all(meets_requirements(v, pin) for v in proxmoxes), (pin, proxmoxes)
    below = Version(proxmoxes[0])
    assert not meets_requirements(f"{below.major}.{below.minor - 1}.99", pin), pin
    assert not meets_requirements(next_minor(proxmoxes[-1]), pin), (pin, proxmoxes)
    requirements = yaml.safe_load((REPO / "requirements.yml").read_text())["collections"]
    assert requirements == [{"name": "community.proxmox", "version": pin}], requirements


def test_the_ansible_under_test_is_a_tested_release_line():
    """The Ansible the suites run (this venv's, or DFLASH_ANSIBLE_BIN's under make test-newest) is the
    line it is declared as, so a newer `ansible` with another community.proxmox is noticed."""
    core, proxmox, _ = installed(ANSIBLE_BIN)
    declared = {LINES[name]["ansible_core"]: LINES[name]["community_proxmox"]
                for name in LINES if ANSIBLE_BIN.parent.name == name}
    line = ".".join(core.split(".")[:2])
    if declared:
        assert {line: proxmox} == declared, (ANSIBLE_BIN, core, proxmox)
    assert (line, proxmox) in release_lines(), (ANSIBLE_BIN, core, proxmox)


def unit_suite(collection, python):
    """community.proxmox's unit suite of proxmox_pct_remote, as its CI runs it (ansible-test units)."""
    env = {**os.environ, "PATH": f"{ANSIBLE_BIN}:{os.environ['PATH']}"}
    res = subprocess.run([str(ANSIBLE_BIN / "ansible-test"), "units", "--color", "no", "--python", python,
                          UNIT_SUITE], cwd=collection, capture_output=True, text=True, timeout=600,
                         stdin=subprocess.DEVNULL, env=env)
    summary = re.findall(r"^=+ (.*) in [0-9.]+s", res.stdout, re.M)
    return res.returncode, summary[-1] if summary else res.stdout[-3000:] + res.stderr[-3000:]


@pytest.mark.parametrize("patch", PATCHES, ids=[p.stem.removeprefix("community.proxmox-") for p in PATCHES])
def test_the_upstream_patch_passes_community_proxmoxs_unit_suite_which_fails_without_it(patch, tmp_path):
    """A change of docs/patches/ to proxmox_pct_remote and its unit tests, applied to community.proxmox's
    source (from the sdist of the `ansible` package that bundles it): the suite with the new tests fails
    on the connection as released, and passes whole with the change."""
    _, proxmox, python = installed(ANSIBLE_BIN)
    if proxmox != PATCH_BASE:
        pytest.skip(f"the patch is against community.proxmox {PATCH_BASE}, this Ansible has {proxmox}:"
                    " make test-newest runs it")
    source = suite_dir(DEFAULT_DIR, "ansible") / COMMUNITY_PROXMOX
    if not source.is_dir():
        pytest.fail(f"the peer suites are not unpacked ({source}): run `make peer-suites`", pytrace=False)
    patched = tmp_path / "patched" / COMMUNITY_PROXMOX
    shutil.copytree(source, patched)
    applied = subprocess.run(["patch", "-p1", "--batch", "-i", str(patch)], cwd=patched, capture_output=True,
                             text=True, timeout=60)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    released = tmp_path / "released" / COMMUNITY_PROXMOX
    shutil.copytree(source, released)
    shutil.copy2(patched / UNIT_SUITE, released / UNIT_SUITE)  # the new tests, the connection as released
    rc, summary = unit_suite(released, python)
    assert rc != 0 and re.search(r"\d+ failed", summary), summary
    rc, summary = unit_suite(patched, python)
    assert rc == 0 and "failed" not in summary and re.search(r"\d+ passed", summary), summary
