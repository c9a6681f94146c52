"""The playbooks refuse a bad inventory before touching anything (no sim needed), from the repo and with
the collection installed by ansible-galaxy."""

import json
import shutil
import subprocess

import pytest
import yaml

from pvesim.fleet import REPO, VENV_BIN, ansible_env

COLLECTION = REPO / "ansible_collections" / "dflash" / "ops"

PLAYBOOKS = ["deploy.yml", "restart_training.yml", "stop_training.yml", "status.yml", "rollback.yml"]


def run_playbook(playbook, inventory, *args, site=REPO, env=None):
    """ansible-playbook on `site`'s playbooks/`playbook`, from `site`, with the repo's settings unless
    `env` is given."""
    argv = [str(VENV_BIN / "ansible-playbook"), "-i", str(inventory), *args,
            str(site / "playbooks" / playbook)]
    return subprocess.run(argv, env=env or ansible_env(), capture_output=True, text=True, cwd=site,
                          timeout=120, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("playbook", PLAYBOOKS)
def test_playbooks_fail_clearly_without_training_containers(tmp_path, playbook):
    inventory = tmp_path / "hosts.yml"
    inventory.write_text("all:\n  children:\n    proxmox_hosts:\n      hosts:\n        pve1: {}\n")
    res = run_playbook(playbook, inventory)
    assert res.returncode != 0
    assert "has no hosts in group training_containers" in res.stdout


def test_a_container_without_vmid_or_node_is_refused_before_anything_runs(tmp_path):
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(
        "all:\n  children:\n"
        "    proxmox_hosts:\n      hosts:\n        pve1: {ansible_host: 192.0.2.1}\n"
        "    training_containers:\n      hosts:\n"
        "        ct200: {ansible_connection: community.proxmox.proxmox_pct_remote, ansible_host: 192.0.2.1,\n"
        "                proxmox_vmid: 200, proxmox_node: pve1}\n"
        "        ct201: {ansible_connection: community.proxmox.proxmox_pct_remote,\n"
        "                ansible_host: 192.0.2.1}\n")
    res = run_playbook("deploy.yml", inventory)
    assert res.returncode != 0
    assert "ct201: a training container needs proxmox_vmid" in res.stdout
    # any_errors_fatal: ct200 is not touched either (it would be unreachable at 192.0.2.1).
    assert "UNREACHABLE" not in res.stdout


def test_a_run_across_containers_is_checked_on_every_member_before_anything_runs(tmp_path):
    inventory = tmp_path / "hosts.yml"
    container = ("{ansible_connection: community.proxmox.proxmox_pct_remote, ansible_host: 192.0.2.1, "
                 "proxmox_vmid: %d, proxmox_node: pve1, dflash_run_members: %s, dflash_run_address: '%s'}")
    members = "[{host: ct200, drafters: 1, targets: 1}, {host: ct201, drafters: 1, targets: 1}]"
    reordered = "[{host: ct201, drafters: 1, targets: 1}, {host: ct200, drafters: 1, targets: 1}]"
    inventory.write_text(
        "all:\n  children:\n"
        "    proxmox_hosts:\n      hosts:\n        pve1: {ansible_host: 192.0.2.1}\n"
        "    training_containers:\n      hosts:\n"
        f"        ct200: {container % (200, members, '192.0.2.20')}\n"
        f"        ct201: {container % (201, reordered, '')}\n")
    res = run_playbook("stop_training.yml", inventory)
    assert res.returncode != 0
    assert ("ct200: the members of a run must declare the same dflash_run_members (in the same order) "
            "on every member. every member needs dflash_run_address") in res.stdout, res.stdout
    assert "UNREACHABLE" not in res.stdout
    # A limit that leaves a member out is refused: the run is stopped and shown as one.
    inventory.write_text(inventory.read_text().replace(reordered, members).replace("''", "'192.0.2.21'"))
    limited = run_playbook("status.yml", inventory, "-l", "ct200")
    assert limited.returncode != 0
    assert "the play (-l) must include all its members (ct200, ct201), it leaves out ct201." in limited.stdout



# One container that passes the inventory checks; nothing listens at its address, and nothing may connect.
ONE_CONTAINER = (
    "all:\n  children:\n"
    "    proxmox_hosts:\n      hosts:\n        pve1: {ansible_host: 192.0.2.1}\n"
    "    training_containers:\n      hosts:\n"
    "        ct200: {ansible_connection: community.proxmox.proxmox_pct_remote, ansible_host: 192.0.2.1,\n"
    "                proxmox_vmid: 200, proxmox_node: pve1}\n")
WRONG_TYPE = "ct200: argument 'dflash_run_stop_timeout' is of type str and we were unable to convert to int"
MISSPELT = "ct200: dflash_run_stop_timout is not a variable of any role"


@pytest.mark.parametrize("variable, complaint", [
    ("dflash_run_stop_timeout=soon", WRONG_TYPE),
    ("dflash_run_stop_timout=600", MISSPELT),
    # The container would refuse the name only once its venv and release had changed.
    ("dflash_run_name=../../../etc/cron.d/evil",
     'ct200: dflash_run_name is "../../../etc/cron.d/evil": the run\'s name must be a plain file name'),
    ("dflash_release_root=opt/dflash",
     'ct200: dflash_release_root is "opt/dflash", and "opt/dflash" is not an absolute path'),
], ids=["wrong-type", "misspelt", "run-name", "relative-path"])
def test_role_variables_are_checked_before_anything_runs(tmp_path, variable, complaint):
    """Types and names against the roles' specs, the run's name and the container paths: refused on the
    controller before connecting to anything (the node at 192.0.2.1 is never tried)."""
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(ONE_CONTAINER)
    res = run_playbook("deploy.yml", inventory, "-e", variable)
    assert res.returncode != 0
    assert complaint in res.stdout, res.stdout
    assert "UNREACHABLE" not in res.stdout


# An option that only the installed copy's dflash_run spec has.
ONLY_INSTALLED = "dflash_run_only_in_the_installed_copy"


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The collection built and installed with ansible-galaxy into a path of its own, and the playbooks
    copied away from the repo with an ansible.cfg that names only that path: a controller that has the
    collection as Galaxy gives it, not the repo's checkout of it. Returns (site, its environment)."""
    root = tmp_path_factory.mktemp("installed")
    collections, site = root / "collections", root / "site"
    shutil.copytree(REPO / "playbooks", site / "playbooks")
    (site / "ansible.cfg").write_text(f"[defaults]\ncollections_path = {collections}\n")
    env = ansible_env(ANSIBLE_CONFIG=str(site / "ansible.cfg"))
    env.pop("PYTHONPATH", None)  # the repo on Python's path would offer its own copy of the collection

    def galaxy(*args):
        subprocess.run([str(VENV_BIN / "ansible-galaxy"), "collection", *args], check=True,
                       capture_output=True, text=True, cwd=root, timeout=120, env=env)

    galaxy("build", str(COLLECTION), "--output-path", str(root))
    [artifact] = root.glob("dflash-ops-*.tar.gz")
    galaxy("install", str(artifact), "--no-deps", "--offline")
    spec = collections / "ansible_collections/dflash/ops/roles/dflash_run/meta/argument_specs.yml"
    specs = yaml.safe_load(spec.read_text())
    specs["argument_specs"]["main"]["options"][ONLY_INSTALLED] = {"type": "int", "description": "A marker."}
    spec.write_text(yaml.safe_dump(specs))
    return site, env


@pytest.mark.slow
@pytest.mark.parametrize("variable, complaint", [
    ("dflash_run_stop_timeout=soon", WRONG_TYPE),
    ("dflash_run_stop_timout=600", MISSPELT),
    # Typed by the installed copy's spec alone: the repo's copy would call it misspelt.
    (f"{ONLY_INSTALLED}=many", f"ct200: argument '{ONLY_INSTALLED}' is of type str and we were unable"),
])
def test_the_preflight_reads_the_specs_of_an_installed_collection(installed, tmp_path, variable, complaint):
    site, env = installed
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(ONE_CONTAINER)
    res = run_playbook("deploy.yml", inventory, "-e", variable, site=site, env=env)
    assert res.returncode != 0
    assert complaint in res.stdout, res.stdout + res.stderr
    assert "UNREACHABLE" not in res.stdout



def lookup_role_argument_spec(*args):
    """What the lookup gives for `args` (Jinja literals), through ansible on the controller, from the repo."""
    expression = f"query('dflash.ops.role_argument_spec', {', '.join(args)}) | to_json"
    argv = [str(VENV_BIN / "ansible"), "localhost", "-i", "localhost,", "-c", "local",
            "-m", "ansible.builtin.debug", "-a", f"msg={{{{ {expression} }}}}"]
    return subprocess.run(argv, env=ansible_env(), capture_output=True, text=True, cwd=REPO, timeout=120,
                          stdin=subprocess.DEVNULL)


def test_the_lookup_gives_each_role_s_options_and_names_what_is_not_there():
    res = lookup_role_argument_spec("'dflash_env'", "'dflash_run'")
    assert res.returncode == 0, res.stdout + res.stderr
    [env, run] = json.loads(json.loads(res.stdout.partition(" => ")[2])["msg"])
    specs = yaml.safe_load((COLLECTION / "roles/dflash_run/meta/argument_specs.yml").read_text())
    assert run == specs["argument_specs"]["main"]["options"] and "dflash_env_venv" in env
    res = lookup_role_argument_spec("'dflash_runn'")
    assert res.returncode != 0
    assert "dflash.ops has no role 'dflash_runn' with an argument spec" in res.stdout
    assert "its roles: dflash_env, dflash_release, dflash_run, proxmox_host, proxmox_provision" in res.stdout
    res = lookup_role_argument_spec("'dflash_release'", "entry_point='stop'")
    assert res.returncode != 0
    assert "role dflash.ops.dflash_release has no entry point 'stop'" in res.stdout, res.stdout
    assert "(it has main, rollback)" in res.stdout
