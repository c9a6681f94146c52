"""Each role's molecule `default` scenario: create (pvesim), converge, idempotence, verify, destroy."""

import subprocess

import pytest

from pvesim.fleet import REPO, VENV_BIN, ansible_env, prepare_assets

pytestmark = [pytest.mark.sim, pytest.mark.slow]

ROLES_DIR = REPO / "ansible_collections" / "dflash" / "ops" / "roles"
ROLES = ["proxmox_host", "proxmox_provision", "dflash_env", "dflash_release", "dflash_run"]
# Roles whose scenario runs only under `make test-reliability`: under `make test` the playbook tests
# cover them (test_provision.py: create, check mode, diff, idempotence; test_playbooks.py: the node's
# checks, releases, rollback and the run's lifecycle). One scenario (dflash_env's) stays in make test,
# so molecule itself, pvesim's create and destroy and the idempotence step are checked on every run.
FULL_ONLY = {"proxmox_host", "proxmox_provision", "dflash_release", "dflash_run"}


@pytest.mark.parametrize("role", [pytest.param(r, marks=pytest.mark.reliability_full) if r in FULL_ONLY
                                  else r for r in ROLES])
def test_molecule_default_scenario(role):
    prepare_assets()
    env = ansible_env()
    env.pop("ANSIBLE_CONFIG")  # molecule writes its own ansible.cfg for the scenario
    res = subprocess.run([str(VENV_BIN / "molecule"), "test"], cwd=ROLES_DIR / role, env=env,
                         capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    output = res.stdout + res.stderr
    assert res.returncode == 0, output[-6000:]
    # The idempotence step ran and passed (molecule fails the run otherwise; this guards the sequence).
    assert "idempotence" in output
