"""Shared fixtures: a pvesim for the whole session, fresh sims on demand, and Ansible against them.

Tests marked `sim` need root, lxc and openssh-server (CI has them). They fail, loudly, on a machine
without them: a skipped foundation would hide every later failure.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# The module tests import ansible's module_utils, which replaces sys.intern with an object; torch's
# compiler, imported later by transformers in the trainer tests of the same process, then fails to
# wrap sys.intern ("substitute_in_graph expects a function"). Importing it first keeps both usable.
# (In production the two never share a process.)
import torch._dynamo  # noqa: E402, F401, I001

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import pvesim  # noqa: E402  (importable from a plain checkout, before `pip install -e .`)
from pvesim.fleet import VENV_BIN, ansible_env, prepare_assets  # noqa: E402
from tests.reliability.trial_counts import FULL  # noqa: E402

# The session's sim: two nodes with two containers each, eight GPUs per node.
SESSION_LAYOUT = {"nodes": 2, "containers": (200, 201, 202, 203), "gpus": 8}


def pytest_configure(config):
    """Under xdist (make test), build the cache every worker reads, the tiny demo assets, once in the
    controller before the workers start, so that no two of them build it at once."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        prepare_assets()


FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """Each test file's seconds (setup, call and teardown of its tests, which --dist loadfile runs on one
    worker one after another): the per-file figures of docs/RELIABILITY.md."""
    path = report.nodeid.split("::", 1)[0]
    FILE_SECONDS[path] = FILE_SECONDS.get(path, 0.0) + report.duration


# How many of the longest files a run that is not the reliability suite's lists (make test's time: 20 minutes
# at most on a 2-core machine, so its longest files are where to look when it grows).
LONGEST_FILES = 15


def pytest_terminal_summary(terminalreporter, config):
    """Under `make test-reliability` (and its slice): every file's seconds, longest first; in another run
    of more than one file (make test), the longest LONGEST_FILES."""
    if len(FILE_SECONDS) < 2:
        return
    every = "reliability" in (config.getoption("markexpr") or "")
    longest = sorted(FILE_SECONDS.items(), key=lambda item: -item[1])
    if not every:
        longest = longest[:LONGEST_FILES]
    terminalreporter.section("seconds per test file" if every else f"the {LONGEST_FILES} longest test files")
    for path, seconds in longest:
        terminalreporter.write_line(f"{seconds:8.1f}  {path}")


def pytest_collection_modifyitems(config, items):
    """Tests marked `reliability_full`, wherever they are, run only under `make test-reliability`
    (DFLASH_RELIABILITY_FULL=1), which selects them with the suite under tests/reliability, or when
    `-m reliability_slice` selects them as a case of the slice (`make test-reliability-slice`); tests
    marked `serve` (or `rehearsal`, `prometheus`) only when `-m` names them (`make serve-check`, `make
    rehearsal`, `make test-prometheus`), never in a plain run (make test)."""
    skip_full = pytest.mark.skip(reason="full reliability suite only (make test-reliability)")
    skip_serve = pytest.mark.skip(reason="heavy (vLLM engines): runs under `make serve-check` (-m serve)")
    skip_rehearsal = pytest.mark.skip(reason="heavy (Qwen3-8B's width, GiBs): runs under `make rehearsal`")
    skip_prometheus = pytest.mark.skip(reason="a real Prometheus end to end: runs under make test-prometheus")
    selected = config.getoption("markexpr") or ""
    # The playbook files first (each deploys fleets of its own: the longest), then the other files that
    # use sims, then the other slow ones, then the rest, each file's tests in their order: xdist hands
    # whole files (--dist loadfile) to whichever worker is free, so the long ones start early and the
    # short ones fill the end instead of one long file running on alone.
    order = {}
    for item in items:
        sim = item.get_closest_marker("sim")
        weight = (0 if sim and item.path.parent.name == "roles" else 1 if sim
                  else 2 if item.get_closest_marker("slow") else 3)
        order[item.path] = min(order.get(item.path, 3), weight)
    items.sort(key=lambda item: order[item.path])  # stable: a file's tests keep their order
    for item in items:
        sliced = "reliability_slice" in selected and item.get_closest_marker("reliability_slice")
        if not FULL and item.get_closest_marker("reliability_full") and not sliced:
            item.add_marker(skip_full)
        if "serve" not in selected and item.get_closest_marker("serve"):
            item.add_marker(skip_serve)
        if "prometheus" not in selected and item.get_closest_marker("prometheus"):
            item.add_marker(skip_prometheus)
        if "rehearsal" not in selected and item.get_closest_marker("rehearsal"):
            item.add_marker(skip_rehearsal)


def require_sim_machine():
    """Fail (not skip) with what is missing when this machine cannot run pvesim."""
    missing = [tool for tool in ("lxc-start", "lxc-attach", "/usr/sbin/sshd", "ssh", "ssh-keygen")
               if not shutil.which(tool)]
    if os.geteuid() != 0:
        missing.append("root")
    if missing:
        pytest.fail("pvesim needs root, lxc and openssh-server (`make setup`); missing: "
                    + ", ".join(missing), pytrace=False)


def bring_up(tmp_dir, **layout):
    require_sim_machine()
    try:
        return pvesim.up(state_dir=tmp_dir / "state", inventory=tmp_dir / "hosts.yml", **layout)
    except pvesim.SimError as e:
        pytest.fail(f"pvesim up failed: {e}", pytrace=False)


@pytest.fixture(scope="session")
def sim(tmp_path_factory):
    """pve1 (CT 200, 201) and pve2 (CT 202, 203), 8 GPUs each, own state dir and inventory file."""
    s = bring_up(tmp_path_factory.mktemp("pvesim"), **SESSION_LAYOUT)
    yield s
    pvesim.down(s.state_dir)


@pytest.fixture(scope="session")
def sudo_sim(tmp_path_factory):
    """pve1 with CT 390, reached as the node user `ansible` (pct through production's sudo rule)."""
    s = bring_up(tmp_path_factory.mktemp("pvesim-sudo"), nodes=1, containers=(390,), gpus=0,
                 node_user="ansible")
    yield s
    pvesim.down(s.state_dir)


@pytest.fixture
def sim_factory(tmp_path_factory):
    """Bring up extra sims inside one test: `sim_factory(nodes=1, containers=(300,), gpus=0)`."""
    started = []

    def make(**layout):
        s = bring_up(tmp_path_factory.mktemp("pvesim-extra"), **layout)
        started.append(s.state_dir)
        return s

    yield make
    for state_dir in started:
        pvesim.down(state_dir)


@pytest.fixture(scope="session")
def run_ansible(sim):
    """run_ansible("ansible", "all", "-m", "ansible.builtin.ping") against the session sim's inventory.

    The first argument names the program (ansible, ansible-playbook, ansible-inventory); the inventory
    is passed with -i. Returns the CompletedProcess (text, stdout and stderr captured).
    """

    def run(program, *args, inventory=None, timeout=300, check=False):
        argv = [str(VENV_BIN / program), "-i", str(inventory or sim.inventory_path), *args]
        res = subprocess.run(argv, env=ansible_env(), capture_output=True, text=True, timeout=timeout,
                             cwd=REPO_ROOT, stdin=subprocess.DEVNULL)
        if check and res.returncode != 0:
            pytest.fail(f"{' '.join(argv)} exited {res.returncode}\n{res.stdout}\n{res.stderr}",
                        pytrace=False)
        return res

    return run


@pytest.fixture
def small_filesystem():
    """small_filesystem(path, size): a filesystem of `size` bytes (tmpfs) mounted at `path` (made if
    missing) for this test, unmounted after it, to fill a disk without filling the machine's."""
    mounted = []

    def mount(path, size):
        require_sim_machine()  # root
        Path(path).mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)],
                       check=True)
        mounted.append(path)
        return Path(path)

    yield mount
    for path in reversed(mounted):
        subprocess.run(["umount", "--lazy", str(path)], check=False)
