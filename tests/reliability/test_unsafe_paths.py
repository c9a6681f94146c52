"""Paths a deploy writes in a container, replaced by a symbolic link to a file root owns elsewhere:
the run's log is refused the way an unsafe pidfile is (named, with the fix), nothing is stopped or
started, and nothing is written through the link; with the link gone the next deploy starts the run.
status.yml never reads a status.json that is a link.

On the stop tests' fleet (tests/reliability/conftest.py's `fleet`), CT 203."""

import pytest

from tests.reliability.stops_support import LOG, ensure_runs, live_run

# Under make test-reliability only (1.5 min): make test keeps the module's refusals of a symlinked log,
# pidfile, secrets file and lock (tests/modules/test_training_run_files.py).
pytestmark = [pytest.mark.sim, pytest.mark.slow, pytest.mark.reliability_full]

VMID = 203
ROOTS_FILE = "/etc/dflash-probe.conf"
ROOTS_JSON = "/etc/dflash-probe.json"
STATUS = "/var/lib/dflash/runs/main/status.json"


def test_a_symlinked_log_is_refused_by_restart_and_deploy_and_nothing_is_written_through_it(fleet):
    ensure_runs(fleet, [VMID], live=True)
    before = live_run(fleet, VMID)
    done = fleet.ct(VMID, f"printf 'kept = yes\\n' > {ROOTS_FILE} && chmod 0644 {ROOTS_FILE} "
                          f"&& mv {LOG} {LOG}.kept && ln -s {ROOTS_FILE} {LOG}")
    assert done.returncode == 0, done.stderr
    try:
        restart = fleet.play("restart_training.yml", "-l", f"ct{VMID}")
        assert restart.rc != 0, restart
        said = restart.messages()
        assert f"log_path {LOG} is a symbolic link (to {ROOTS_FILE})" in said, said
        assert "nothing was signalled or started" in said, said
        assert live_run(fleet, VMID) == before, "the run changed under a refused log"

        ensure_runs(fleet, [VMID], live=False)  # a stop does not need the log
        deploy = fleet.play("deploy.yml", "-l", f"ct{VMID}")
        assert deploy.rc != 0 and f"log_path {LOG} is a symbolic link" in deploy.messages(), deploy
        assert live_run(fleet, VMID) is None, "a run started on a symlinked log"
        assert fleet.read(VMID, ROOTS_FILE) == "kept = yes\n"  # nothing appended through the link

        # status.yml never reads a status.json that is a link (to a file root owns elsewhere).
        fleet.ct(VMID, f"printf '{{\"state\": \"running\", \"step\": 987654}}' > {ROOTS_JSON} && "
                       f"mv {STATUS} {STATUS}.kept && ln -s {ROOTS_JSON} {STATUS}")
        status = fleet.play("status.yml", "-l", f"ct{VMID}")
        assert status.rc == 0 and "987654" not in str(list(status.host_results())), status
        print(f"a symlinked log: restart and deploy refused ({said[:160]}...); {ROOTS_FILE} untouched; "
              f"a symlinked status.json is not read")
    finally:
        fleet.ct(VMID, f"rm -f {LOG} {ROOTS_FILE} {ROOTS_JSON}; mv {LOG}.kept {LOG}; "
                       f"[ -e {STATUS}.kept ] && rm -f {STATUS} && mv {STATUS}.kept {STATUS}")
    ensure_runs(fleet, [VMID], live=True)
    assert live_run(fleet, VMID) is not None
