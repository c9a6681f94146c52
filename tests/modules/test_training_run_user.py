"""training_run's `user`: the run runs as that unprivileged user (its groups, gid and uid set in the child
before the exec, its HOME and USER), while the pidfile, the log and the checks of what it runs stay root's;
its GPUs must be reachable by it; its secrets file may be its own (0600); the boot unit's command is
quoted as systemd reads it."""

from __future__ import annotations

import os
import shlex
import shutil
import stat
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from module_runner import alive, run_module

from ansible_collections.dflash.ops.plugins.module_utils import run_boot
from ansible_collections.dflash.ops.plugins.module_utils.run_pidfile import RunError
from ansible_collections.dflash.ops.plugins.module_utils.run_start import (
    device_refusal,
    may_use,
    own_directories,
    reach_refusal,
    read_environment_file,
    read_refusal,
    run_identity,
)
from tests.waiting import wait_for

FAKE_RUN = str(Path(__file__).parent / "fixtures" / "fake_run.py")
# The system python: the venv's may sit under /root, which another user cannot reach.
SYSTEM_PYTHON = "/usr/bin/python3"
NOBODY = 65534

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="dropping privileges needs root")


def proc_status(pid):
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {key: value.split() for key, value in fields.items() if key in ("Uid", "Gid", "Groups")}


@pytest.fixture
def fake_run_for_others():
    """fake_run.py where another user can read it: the checkout may sit in root's 0700 home."""
    base = Path(tempfile.mkdtemp(dir="/var/tmp"))
    base.chmod(0o755)
    script = base / "fake_run.py"
    shutil.copyfile(FAKE_RUN, script)
    script.chmod(0o644)
    yield str(script)
    shutil.rmtree(base)


@needs_root
def test_the_run_runs_as_its_user_and_the_stop_still_ends_it(tmp_path, processes, fake_run_for_others):
    pidfile, log = tmp_path / "main.pid", tmp_path / "main.log"
    args = {"name": "main", "pidfile": str(pidfile), "log_path": str(log), "user": "nobody",
            "command": [SYSTEM_PYTHON, fake_run_for_others, "--step-after", "0.2"],
            "wait_for": '"event": *"step"'}
    started, rc = run_module("training_run", args)
    assert rc == 0, started
    pid = started["pid"]
    processes.track(pid)
    status = proc_status(pid)
    assert status["Uid"] == [str(NOBODY)] * 4 and status["Gid"] == [str(NOBODY)] * 4, status
    assert status["Groups"] == [str(NOBODY)], status  # nogroup alone: root's groups are gone
    environ = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0")
                   if item)
    assert (environ["USER"], environ["HOME"]) == ("nobody", "/nonexistent"), environ
    assert (started["run"]["user"], started["run"]["uid"]) == ("nobody", NOBODY)
    # What stays root's: the pidfile and the log (the run writes it through the start's descriptor).
    assert pidfile.stat().st_uid == 0 and log.stat().st_uid == 0
    assert '"event": "step"' in log.read_text()

    again, rc = run_module("training_run", dict(args, user=None))
    assert rc == 1 and "another command or user" in again["msg"], again
    stopped, rc = run_module("training_run", {"name": "main", "pidfile": str(pidfile), "state": "stopped",
                                              "stop_timeout": 10})
    assert rc == 0 and stopped["how"] == "terminated", stopped
    assert wait_for(lambda: not alive(pid))


def test_an_unknown_user_or_root_by_name_is_refused_before_anything():
    with pytest.raises(RunError, match="no such user"):
        run_identity("no-such-dflash-user")
    with pytest.raises(RunError, match="uid 0"):
        run_identity("root")
    assert run_identity(None) is None


def test_a_user_may_use_a_device_through_its_owner_group_or_others_bits():
    user = {"name": "trainer", "uid": 990, "gid": 990, "groups": [44, 990]}
    device = lambda uid, gid, mode: SimpleNamespace(st_uid=uid, st_gid=gid, st_mode=stat.S_IFCHR | mode)  # noqa: E731
    assert may_use(device(0, 44, 0o660), user)  # devN: ...,gid=44,mode=0660
    assert may_use(device(0, 0, 0o666), user)
    assert not may_use(device(0, 0, 0o660), user)
    assert not may_use(device(0, 44, 0o640), user)  # read only
    assert not may_use(device(990, 44, 0o066), user)  # the owner's bits count for the owner


@needs_root
def test_a_gpu_device_the_user_cannot_use_refuses_the_start(tmp_path):
    device = tmp_path / "nvidia0"
    os.mknod(device, stat.S_IFCHR | 0o660, os.makedev(1, 3))
    device.chmod(0o660)  # mknod's mode goes through the umask
    nobody = run_identity("nobody")
    refused = device_refusal(nobody, [str(tmp_path / "nvidia*")])
    assert refused and str(device) in refused and "gid=<gid>,mode=0660" in refused
    os.chown(device, 0, NOBODY)
    assert device_refusal(nobody, [str(tmp_path / "nvidia*")]) is None


@needs_root
def test_the_secrets_file_may_be_the_run_users_and_no_one_elses(tmp_path):
    secrets = tmp_path / "main.env"
    secrets.write_text("HF_TOKEN=abc\n")
    secrets.chmod(0o600)
    os.chown(secrets, NOBODY, NOBODY)
    assert read_environment_file(str(secrets), "nobody") == {"HF_TOKEN": "abc"}
    with pytest.raises(RunError, match="owned by uid 0 or by nobody"):
        secrets.chmod(0o640)
        read_environment_file(str(secrets), "nobody")
    secrets.chmod(0o600)
    with pytest.raises(RunError, match="owned by uid 0 and readable"):
        read_environment_file(str(secrets))  # without the user: root's alone


def test_the_boot_units_command_is_quoted_as_systemd_reads_it():
    argv = ["/usr/bin/python3", "/opt/my lib/dflash-resume.pyz", '/var/lib/"d"\\flash']
    line = run_boot.exec_start(argv)
    assert line == '"/usr/bin/python3" "/opt/my lib/dflash-resume.pyz" "/var/lib/\\"d\\"\\\\flash"'
    assert shlex.split(line) == argv  # as pvesim's init (and a shell) splits it
    # systemd expands specifiers and variables inside quotes too: both doubled.
    assert run_boot.exec_start(["/srv/100%/$HOME"]) == '"/srv/100%%/$$HOME"'



@needs_root
def test_the_runs_directories_become_its_users_without_following_a_link(tmp_path):
    outside = tmp_path / "outside"
    outside.write_text("root's")
    out = tmp_path / "out"
    (out / "step-10").mkdir(parents=True)
    (out / "step-10" / "model.pt").write_text("weights")
    (out / "link").symlink_to(outside)
    os.link(outside, out / "second-name")  # a file with two names: one may be outside
    nobody = run_identity("nobody")
    assert own_directories([str(out), str(tmp_path / "new")], nobody) == [str(out), str(tmp_path / "new")]
    for path in (out, out / "step-10", out / "step-10" / "model.pt", out / "link", tmp_path / "new"):
        assert path.lstat().st_uid == NOBODY, path
    assert outside.stat().st_uid == 0 and (out / "second-name").stat().st_uid == 0
    assert own_directories([str(out)], nobody) == []  # nothing left to change


@needs_root
def test_what_the_user_cannot_reach_refuses_the_start():
    """pvesim's venv python links to the machine's python under /root (0700): the start says so before it
    stops anything."""
    base = Path(tempfile.mkdtemp(dir="/var/tmp"))  # pytest's own directory is root's alone
    try:
        reach_checks(base)
    finally:
        shutil.rmtree(base)


def reach_checks(tmp_path):
    tmp_path.chmod(0o755)
    nobody = run_identity("nobody")
    assert reach_refusal(nobody, "/bin/sh", SYSTEM_PYTHON, "/") is None
    private = tmp_path / "private"
    private.mkdir()
    private.chmod(0o700)
    (private / "python").symlink_to(SYSTEM_PYTHON)
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / "python").symlink_to(private / "python")
    refused = reach_refusal(nobody, "/bin/sh", str(venv / "python"), "/")
    assert refused and f"enter {private} " in refused, refused
    private.chmod(0o711)
    assert reach_refusal(nobody, "/bin/sh", str(venv / "python"), "/") is None


@needs_root
def test_a_venv_directory_the_user_cannot_list_refuses_the_start():
    """Python drops a path entry it cannot read in silence: a venv whose .pth file names a directory the
    run's user cannot list and enter (the controller's site-packages under root's 0700 home, say) would
    start and fail at its first import after the good run was stopped. The start names it first."""
    base = Path(tempfile.mkdtemp(dir="/var/tmp"))  # pytest's own directory is root's alone
    try:
        base.chmod(0o755)
        venv, elsewhere = base / "venv", base / "elsewhere"
        site = venv / "lib" / "python3.11" / "site-packages"
        site.mkdir(parents=True)
        (venv / "bin").mkdir()
        (venv / "bin" / "python").symlink_to(SYSTEM_PYTHON)
        (venv / "pyvenv.cfg").write_text("include-system-site-packages = false\n")
        packages = elsewhere / "site-packages"
        packages.mkdir(parents=True)
        (site / "extra.pth").write_text(f"# the controller's packages\nimport os\n{packages}\n")
        nobody = run_identity("nobody")
        python = str(venv / "bin" / "python")
        assert reach_refusal(nobody, "/bin/sh", python, "/") is None
        packages.chmod(0o700)
        refused = reach_refusal(nobody, "/bin/sh", python, "/")
        assert refused and f"it may not list and enter {packages} (mode 0700)" in refused, refused
        packages.chmod(0o755)
        elsewhere.chmod(0o700)  # a directory on the way
        refused = reach_refusal(nobody, "/bin/sh", python, "/")
        assert refused and f"it may not enter {elsewhere} " in refused, refused
        elsewhere.chmod(0o755)
        site.chmod(0o711)  # the venv's own site-packages: entered, not listed
        refused = reach_refusal(nobody, "/bin/sh", python, "/")
        assert refused and f"it may not list and enter {site} " in refused, refused
    finally:
        shutil.rmtree(base)


@needs_root
def test_a_model_or_data_the_user_cannot_read_refuses_the_start():
    """A model saved 0600 by root: the start says which file before it stops anything, instead of a
    successor that fails when it opens the weights."""
    base = Path(tempfile.mkdtemp(dir="/var/tmp"))  # pytest's own directory is root's alone
    try:
        base.chmod(0o755)
        model, data = base / "model", base / "data" / "train.jsonl"
        model.mkdir()
        data.parent.mkdir()
        for path in (model / "config.json", model / "model.safetensors", data):
            path.write_text("{}")
            path.chmod(0o644)
        (model / "model.safetensors").chmod(0o600)
        nobody = run_identity("nobody")
        wanted = [str(model), str(data), str(base / "missing")]  # what is not there: the validation's to say
        refused = read_refusal(nobody, wanted)
        assert refused and f"it may not read {model / 'model.safetensors'} (mode 0600)" in refused, refused
        (model / "model.safetensors").chmod(0o640)
        os.chown(model / "model.safetensors", 0, NOBODY)  # through its group
        assert read_refusal(nobody, wanted) is None
        data.parent.chmod(0o700)
        refused = read_refusal(nobody, wanted)
        assert refused and f"it may not enter {data.parent} " in refused, refused
        data.parent.chmod(0o755)
        data.chmod(0o600)
        assert f"it may not read {data} " in read_refusal(nobody, wanted)
    finally:
        shutil.rmtree(base)
