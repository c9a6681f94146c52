"""A shared machine's other users get neither the run's secret nor a say in what runs as root: the
secrets file is never readable by another user of the container, not even while a first deploy writes it,
and goes when the secrets are emptied; a restart's async job files are in a directory only root may
enter; a release archive swapped in the controller's cache under the same release id is not shipped
(pvesim, one container; docs/SECURITY.md)."""

from __future__ import annotations

import base64
import io
import json
import shlex
import subprocess
import sys
import tarfile

import pytest

from pvesim.fleet import Fleet, change_code
from tests.run_user import readable_assets, site_packages_for_run_user
from tests.waiting import wait_for

pytestmark = [pytest.mark.sim, pytest.mark.slow]

VMID = 200
SECRETS = "/var/lib/dflash/secrets"
ASYNC_DIR = "/root/.ansible_async"  # the dflash_run role's __dflash_run_async_dir
TOKEN = "hf_shared_machine_token_9a0364b9e99bb480"
# Polls as uid 65534 (nobody) for the secrets file and its directory until the stop file exists; writes
# how often it tried and what it could read.
POLLER = r"""
import json, os, sys
secret, stop, out = sys.argv[1:4]
tries, read, listed = 0, [], False
open(out + ".ready", "w").close()
while not os.path.exists(stop):
    tries += 1
    try:
        with open(secret) as fh:
            read.append(fh.read())
    except OSError:
        pass
    try:
        listed = listed or bool(os.listdir(os.path.dirname(secret)))
    except OSError:
        pass
with open(out, "w") as fh:
    json.dump({"tries": tries, "read": [r for r in read if r], "listed": listed}, fh)
"""


@pytest.fixture(scope="module")
def site_packages():
    """The venv's site-packages where the run's user may read them, whatever the checkout's mode
    (tests/run_user.py), staged before the fleet's containers start."""
    with site_packages_for_run_user() as path:
        yield path


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, site_packages):
    f = Fleet(tmp_path_factory.mktemp("secrets-fleet"), nodes=1, containers=(VMID,))
    yield f
    f.down()


def secrets_file(fleet, name, secrets):
    path = fleet.base / name
    path.write_text(json.dumps({"dflash_run_secret_environment": secrets}))
    path.chmod(0o600)
    return str(path)


class Poller:
    """POLLER running as nobody in the container, through the node's sshd and pct (started by pid here)."""

    def __init__(self, fleet):
        self.fleet, self.out = fleet, "/tmp/secret-poll.json"
        fleet.ct(VMID, f"rm -f {self.out} {self.out}.ready /tmp/secret-poll.stop")
        script = (f"setpriv --reuid 65534 --regid 65534 --clear-groups {sys.executable} -c "
                  f"{shlex.quote(POLLER)} {SECRETS}/main.env /tmp/secret-poll.stop {self.out}")
        node = fleet.sim.node_of(VMID).name
        self.proc = subprocess.Popen(
            [*fleet.sim.ssh_argv(node), f"/usr/sbin/pct exec {VMID} -- /bin/sh -c {shlex.quote(script)}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        assert wait_for(lambda: fleet.ct(VMID, f"test -e {self.out}.ready").returncode == 0, timeout=60)

    def result(self):
        self.fleet.ct(VMID, "touch /tmp/secret-poll.stop")
        try:
            self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        return json.loads(self.fleet.read(VMID, self.out))


def test_another_user_never_reads_the_secret_while_first_deploys_write_it(fleet):
    assert fleet.play("deploy.yml").rc == 0
    with_secret = secrets_file(fleet, "secrets.json", {"HF_TOKEN": TOKEN})
    for _ in range(2):  # each a first deploy of the secret: no directory, no file
        assert fleet.ct(VMID, f"rm -rf {SECRETS}").returncode == 0
        poller = Poller(fleet)
        res = fleet.play("restart_training.yml", "-e", f"@{with_secret}")
        seen = poller.result()
        assert res.rc == 0, res
        assert seen["tries"] > 0 and seen["read"] == [] and not seen["listed"], seen
        assert fleet.ct(VMID, f"stat -c '%a %U' {SECRETS} {SECRETS}/main.env").stdout.split() == \
            ["700", "root", "600", "root"]
    pid = fleet.run_info(VMID)["pid"]
    environ = fleet.ct(VMID, f"tr '\\0' '\\n' < /proc/{pid}/environ").stdout.splitlines()
    assert f"HF_TOKEN={TOKEN}" in environ


def test_emptied_secrets_remove_the_file(fleet):
    with_secret = secrets_file(fleet, "secrets.json", {"HF_TOKEN": TOKEN})
    assert fleet.play("restart_training.yml", "-e", f"@{with_secret}").rc == 0
    assert fleet.ct(VMID, f"test -f {SECRETS}/main.env").returncode == 0
    emptied = secrets_file(fleet, "emptied.json", {})
    res = fleet.play("restart_training.yml", "-e", f"@{emptied}")
    assert res.rc == 0, res
    assert fleet.ct(VMID, f"test -e {SECRETS}/main.env").returncode == 1
    boot = json.loads(fleet.read(VMID, "/var/lib/dflash/main.boot.json"))
    assert not boot.get("environment_file"), boot
    pid = fleet.run_info(VMID)["pid"]
    assert TOKEN not in fleet.ct(VMID, f"tr '\\0' '\\n' < /proc/{pid}/environ").stdout


def test_a_restarts_async_job_directory_is_roots_alone(fleet):
    assert fleet.play("deploy.yml").rc == 0
    # As Ansible's async wrapper leaves a directory it makes (umask 022): every user may list and read it.
    assert fleet.ct(VMID, f"mkdir -p {ASYNC_DIR} && chmod 0755 {ASYNC_DIR}").returncode == 0
    res = fleet.play("restart_training.yml")
    assert res.rc == 0, res
    assert fleet.ct(VMID, f"stat -c '%a %U' {ASYNC_DIR}").stdout.split() == ["700", "root"]
    readable = fleet.ct(VMID, f"find {ASYNC_DIR} -mindepth 1 -perm /044")
    assert readable.returncode == 0 and readable.stdout == "", readable


def evil_archive(real):
    """The bytes of `real` (a release archive) with run.sh replaced by `echo EVIL`, everything else kept."""
    out = io.BytesIO()
    with tarfile.open(real) as tar, tarfile.open(fileobj=out, mode="w:gz") as evil:
        for member in tar.getmembers():
            data = b"#!/bin/sh\necho EVIL\n" if member.name == "run.sh" else tar.extractfile(member).read()
            member.size = len(data)
            evil.addfile(member, io.BytesIO(data))
    return out.getvalue()


def test_an_archive_swapped_in_the_controllers_cache_under_the_same_id_is_not_shipped(fleet):
    assert fleet.play("deploy.yml").rc == 0
    first = fleet.live_release(VMID)
    release_id = first.rsplit("/", 1)[1]
    init = fleet.src / "dflash_ops" / "__init__.py"
    original = init.read_text()
    change_code(fleet.src, "swap")
    assert fleet.play("deploy.yml").rc == 0 and fleet.live_release(VMID) != first
    # Back to the first release's source, which the container no longer has, and its cached archive's
    # base64 text replaced by another user of the controller.
    init.write_text(original)
    assert fleet.ct(VMID, f"rm -rf {first} /opt/dflash/previous").returncode == 0
    cached = fleet.build_dir / f"{release_id}.tar.gz"
    (fleet.build_dir / f"{release_id}.tar.gz.b64").write_bytes(base64.b64encode(evil_archive(cached)))
    res = fleet.play("deploy.yml")
    assert res.rc == 0, res
    assert fleet.live_release(VMID) == first
    assert "EVIL" not in fleet.read(VMID, f"{first}/run.sh")
    assert "release cache was not trusted" in res.stdout + res.stderr
    assert "EVIL" not in fleet.read(VMID, "/var/log/dflash/main.log")


def test_the_trainer_runs_as_dflash_run_user(fleet, site_packages):
    """Last in this file: it leaves the run as that user. A deploy with dflash_run_user restarts the run
    as that user: its processes have its uid, its secrets file is its own and no one else's, its GPUs are
    busy as gpu_verify sees them, it cannot change what it runs, and a stop still checkpoints and ends it."""
    user_vars = fleet.base / "run-user.json"
    user_vars.write_text(json.dumps({"dflash_run_user": "dflash", "dflash_env_site_packages": [site_packages],
                                     "dflash_run_secret_environment": {"HF_TOKEN": TOKEN}}))
    user_vars.chmod(0o600)
    assert fleet.play("deploy.yml").rc == 0  # a run as root first: its output directory is root's
    before = fleet.run_info(VMID)
    # pvesim's venv python links to the machine's, under the container's /root (0700): the user cannot run
    # it, which the start finds before it stops anything. A real container's venv is on /usr/bin/python3.
    refused = fleet.play("deploy.yml", "-e", f"@{user_vars}")
    assert refused.rc != 0 and "may not enter /root " in refused.stdout, refused.stdout[-4000:]
    assert fleet.alive(VMID, before["pid"]) and fleet.run_info(VMID)["pid"] == before["pid"]
    assert fleet.ct(VMID, "chmod 0711 /root").returncode == 0
    # The sim's tiny model and data are written 0600, in a checkout that may be root's alone: the user
    # could not read them, which the start finds before it stops anything too (the run it would stop is a
    # good one).
    refused = fleet.play("deploy.yml", "-e", f"@{user_vars}")
    assert "cannot start run as user dflash: it may not " in refused.stdout, refused.stdout[-4000:]
    assert refused.rc != 0 and f"on the way to {fleet.assets}/" in refused.stdout, refused.stdout[-4000:]
    assert fleet.alive(VMID, before["pid"]) and fleet.run_info(VMID)["pid"] == before["pid"]
    # A copy the user may read, in the container's own filesystem.
    readable = readable_assets(fleet, VMID)
    user_vars.write_text(json.dumps({**json.loads(user_vars.read_text()), "dflash_sim_assets": readable}))
    res = fleet.play("deploy.yml", "-e", f"@{user_vars}")
    assert res.rc == 0, res.stdout[-4000:]
    assert res.results("Wait until the run's GPUs are busy.")[f"ct{VMID}"]["met"]
    uid = int(fleet.ct(VMID, "id -u dflash").stdout)
    run = fleet.run_info(VMID)
    assert (run["user"], run["uid"]) == ("dflash", uid)
    group = fleet.ct(VMID, f"ps -o pid= -g {run['pgid']}").stdout.split()
    assert group, run
    for pid in group:
        status = fleet.read(VMID, f"/proc/{pid}/status").splitlines()
        uids = [line for line in status if line.startswith("Uid:")]
        assert uids == [f"Uid:\t{uid}\t{uid}\t{uid}\t{uid}"], (pid, uids)
    assert "video" in fleet.ct(VMID, "id -nG dflash").stdout.split()
    assert fleet.ct(VMID, f"stat -c '%a %U' {SECRETS} {SECRETS}/main.env").stdout.split() == \
        ["711", "root", "600", "dflash"]
    nobody = "setpriv --reuid 65534 --regid 65534 --clear-groups"
    assert fleet.ct(VMID, f"{nobody} cat {SECRETS}/main.env").returncode != 0
    assert fleet.ct(VMID, f"{nobody} ls {SECRETS}").returncode != 0
    as_user = f"setpriv --reuid {uid} --regid {uid} --init-groups"
    assert fleet.ct(VMID, f"{as_user} cat {SECRETS}/main.env").stdout == f"HF_TOKEN={TOKEN}\n"
    release = fleet.live_release(VMID)
    assert fleet.ct(VMID, f"{as_user} sh -c 'echo evil >> {release}/run.sh'").returncode != 0
    assert fleet.ct(VMID, f"{as_user} touch {release}/evil").returncode != 0
    assert fleet.ct(VMID, "find /var/lib/dflash/runs/main ! -user dflash").stdout == ""
    fleet.wait_for_checkpoint(VMID)

    stopped = fleet.play("stop_training.yml", "-e", f"@{user_vars}")
    assert stopped.rc == 0, stopped
    stop = stopped.results("Stop the run (the trainer checkpoints on SIGTERM).")[f"ct{VMID}"]
    assert stop["how"] == "terminated", stop
    assert not any(fleet.alive(VMID, pid) for pid in group)
    status = fleet.status(VMID)
    assert status["state"] == "stopped" and status["last_checkpoint"], status
