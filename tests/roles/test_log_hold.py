"""The run log's rotation without a line lost, fast and without a sim: Debian's logrotate runs the rule
proxmox_provision installs (rendered from its template) against a log that writers append to as a run's
processes do (one O_APPEND descriptor shared, one writer in a session of its own as torchrun's workers),
at full speed; every line of each writer is in the rotated files or the new log, in order, none twice.
copytruncate alone loses the lines written between the end of its copy and its truncation (logrotate.c
copyTruncate(): the copy's fsync lies between): dflash-log-hold, the rule's prerotate, holds the writers
through that window. The rotation of a live run's log on a pvesim container:
tests/roles/test_log_rotation.py."""

import gzip
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest

from tests.waiting import wait_for

ROLE = Path(__file__).resolve().parents[2] / "ansible_collections/dflash/ops/roles/proxmox_provision"
HOLD = ROLE / "files" / "dflash-log-hold"
LOGROTATE = shutil.which("logrotate") or "/usr/sbin/logrotate"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="logrotate's rule and the hold run as root")

# Appends numbered lines through the descriptor it inherited (argv[2]), as fast as it can.
WRITER = """
import os, sys
name, fd, n = sys.argv[1].encode(), int(sys.argv[2]), 0
while True:
    os.write(fd, b"%s %d\\n" % (name, n))
    n += 1
"""


def rule(log, hold, rotate=3, compress=True):
    """The role's logrotate rule for `log`, from its template."""
    environment = jinja2.Environment(undefined=jinja2.StrictUndefined)
    environment.filters["bool"] = bool
    template = environment.from_string((ROLE / "templates" / "dflash-logrotate.j2").read_text())
    return template.render(
        ansible_managed="test", proxmox_provision_run_name="main", proxmox_provision_run_log_path=str(log),
        proxmox_provision_logrotate_size="100M", proxmox_provision_logrotate_rotate=rotate,
        proxmox_provision_logrotate_compress=compress, __proxmox_provision_log_hold=str(hold),
        __proxmox_provision_log_hold_python=sys.executable, proxmox_provision_logrotate_hold_seconds=60)


def state(pid):
    with open(f"/proc/{pid}/status") as status:
        return next(line.split()[1] for line in status if line.startswith("State:"))


@pytest.fixture
def logs(tmp_path):
    """A log directory logrotate accepts (not writable by group or others) and two writers of its log."""
    directory = tmp_path / "log"
    directory.mkdir(mode=0o700)
    log = directory / "main.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, name, str(fd)], pass_fds=(fd,),
                                start_new_session=new, stdout=subprocess.DEVNULL)
               for name, new in (("agent", False), ("worker", True))]
    os.close(fd)
    yield log, writers
    for writer in writers:
        writer.send_signal(signal.SIGCONT)
        writer.kill()
        writer.wait()


def lines_of(log):
    """Each writer's numbers, from the oldest rotated log to the live one."""
    rotated = sorted(log.parent.glob(log.name + ".*"), key=lambda p: -int(p.name.split(".")[2]))
    numbers = {}
    for path in [*rotated, log]:
        data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        for name, n in re.findall(rb"^(\w+) (\d+)$", data, flags=re.M):
            numbers.setdefault(name.decode(), []).append(int(n))
    return numbers


def test_a_forced_rotation_under_writers_at_full_speed_loses_no_line(logs, tmp_path):
    log, writers = logs
    conf = tmp_path / "dflash-main"
    conf.write_text(rule(log, HOLD))
    for _ in range(3):
        assert wait_for(lambda: log.exists() and log.stat().st_size > 4096, timeout=30)
        res = subprocess.run([LOGROTATE, "-s", str(tmp_path / "status"), "-f", str(conf)],
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        # The writers go on once the log is truncated: the next lines are in the new log.
        assert wait_for(lambda: log.stat().st_size > 0 and all(state(w.pid) != "T" for w in writers),
                        timeout=30)
    assert sorted(p.name for p in log.parent.iterdir()) == ["main.log", "main.log.1.gz", "main.log.2.gz",
                                                            "main.log.3.gz"]
    for writer in writers:
        writer.send_signal(signal.SIGSTOP)
    numbers = lines_of(log)
    for name in ("agent", "worker"):
        assert numbers[name] == list(range(len(numbers[name]))), f"{name}'s lines have a gap or a repeat"


def test_the_writers_go_on_when_the_log_is_not_truncated_in_time(logs):
    log, writers = logs
    assert wait_for(lambda: log.exists() and log.stat().st_size > 0, timeout=30)
    res = subprocess.run([sys.executable, str(HOLD), str(log), "1"], capture_output=True, text=True,
                         timeout=30)
    assert res.returncode == 0, res.stderr
    assert all(state(w.pid) == "T" for w in writers), "the writers were not held"
    size = log.stat().st_size
    # No copy and no truncation came (a rotation that failed): the guard lets them go on after 1 s.
    assert wait_for(lambda: all(state(w.pid) != "T" for w in writers) and log.stat().st_size > size,
                    timeout=30)


def test_a_log_without_writers_or_absent_holds_nothing(tmp_path):
    log = tmp_path / "main.log"
    res = subprocess.run([sys.executable, str(HOLD), str(log)], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    log.write_text("done\n")
    res = subprocess.run([sys.executable, str(HOLD), str(log)], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
