"""The README's day-one and everyday commands, as written, on inventory/production.example: a checkout of the
repo (its tracked files, copied), the README's `cp -r inventory/production.example inventory/production`,
then, with only what a sim must have changed in the copied inventory (each override in SIM_OVERRIDES, with
why), the README's `ansible-playbook` lines run from the checkout's root exactly as the README prints them
(read from README.md by the test, so an edit of either shows here; the README's `...` placeholder is
filled with a token): the node's preflight, provisioning CT 200 on a fresh node, the first deploy with a
secret, the status, a restart, a stop, the feature cache's capture and the deploy that trains from it, a
rollback, the metrics and an export into the checkout's .cache/. A second provision and a second deploy
change nothing, and the secret's value never appears in Ansible's output. The tests share one sim and run
in order. (regenerate_data.yml's line is left out: tests/roles/test_regenerate_playbook.py runs that playbook,
its refusal of a read-only output among its tests.)"""

import json
import shlex
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from pvesim.fleet import REPO, prepare_assets
from pvesim.sim import NODE_PYTHON, Sim, container_hostvars, down, up
from tests.roles.readme_commands import (
    README,
    checkout,
    readme_command,
    readme_deploy,
    readme_lines,
    run_command,
)

pytestmark = [pytest.mark.sim, pytest.mark.slow]

EXAMPLE = REPO / "inventory" / "production.example"
SIM_GROUP_VARS = REPO / "inventory" / "sim" / "group_vars" / "training_containers.yml"
# The README's node user other than root (`ansible_user: ansible`), under the example's rule for the
# preflight and provisioning, which covers the pct rule of the other playbooks.
USER = "ansible"
PROVISION_RULE = EXAMPLE / "sudoers.d" / "ansible_provision"
VMID = 200  # the example's container, which the sim does not have until provision.yml creates it
HOST = f"ct{VMID}"
SECRET = "hf_exampleInventorySecret0123456789"
# The sim's run of the tiny demo: what inventory/sim says about the release and the run, taken whole.
DEMO_RUN_KEYS = ("dflash_release_device", "dflash_release_target_gpus", "dflash_release_drafter_gpus",
                 "dflash_release_environment", "dflash_run_gpus", "dflash_release_settings",
                 "dflash_run_stop_timeout", "dflash_run_settle_seconds", "dflash_run_progress_timeout",
                 "dflash_run_gpu_timeout")


def sim_overrides(sim, node_root):
    """Every change the test makes to the copied example, by file and host (None: the file's top level),
    and nothing else."""
    pve1 = sim.node("pve1")
    container = container_hostvars(sim, "pve1", VMID)
    demo_run = {key: value for key, value in yaml.safe_load(SIM_GROUP_VARS.read_text()).items()
                if key in DEMO_RUN_KEYS}
    demo_run["dflash_release_settings"]["data"]["eval_path"] = "/srv/data/eval.jsonl"
    example_mounts = yaml.safe_load((EXAMPLE / "group_vars" / "training_containers.yml").read_text())[
        "proxmox_provision_mounts"]
    return {
        # The node is the sim's sshd for pve1 on loopback, logged in to as the README's node user with the
        # sim's key, its host key checked against the sim's known_hosts (the example keeps checking on).
        ("hosts.yml", "pve1"): {
            "ansible_host": pve1.address, "ansible_port": pve1.port, "ansible_user": USER,
            "ansible_ssh_private_key_file": str(sim.private_key),
            "ansible_ssh_common_args":
                f"-o UserKnownHostsFile={sim.known_hosts} -o StrictHostKeyChecking=yes",
            "ansible_python_interpreter": NODE_PYTHON,
        },
        # The container is reached through that node (same address, port, user and key).
        ("hosts.yml", HOST): {
            key: container[key] for key in ("ansible_host", "ansible_port", "ansible_user",
                                            "ansible_private_key_file")
        },
        # The node's directories live under the test's own directory (the sim's node is this machine),
        # not in this machine's /srv.
        ("group_vars/training_containers.yml", None): {
            "proxmox_provision_mounts": [{**m, "node_path": f"{node_root}{m['node_path']}"}
                                         for m in example_mounts],
            # A sim container's root is an overlay of this machine's: the trainer's venv borrows this
            # venv's packages (torch, transformers) instead of installing them from a wheelhouse.
            "dflash_env_python": sys.executable,
            "dflash_env_site_packages": [container["pvesim_site_packages"]],
            "dflash_env_requirements": [],
            # The tiny demo's model and data (in the node's /srv/models and /srv/data, so through the
            # mounts), and the sim's CPU run of it, instead of whatever recipe the example names.
            "dflash_release_target_path": "/srv/models/tiny-demo",
            "dflash_release_data_path": "/srv/data/train.jsonl",
            **demo_run,
        },
    }


def apply_overrides(inventory, overrides):
    for (name, host), values in overrides.items():
        path = inventory / name
        data = yaml.safe_load(path.read_text())
        if host is None:
            data.update(values)
        else:
            groups = data["all"]["children"]
            target = next(g["hosts"][host] for g in groups.values() if host in g.get("hosts", {}))
            target.update(values)
        path.write_text("---\n" + yaml.safe_dump(data, sort_keys=False, width=1000))


def node_directories(node_root, assets):
    """The node's directories the example mounts, as an operator makes them (README): the model, data and
    wheelhouse readable, the container's feature cache and regenerated data owned by its root (uid 100000
    on the node)."""
    shutil.copytree(assets / "target", node_root / "srv" / "models" / "tiny-demo")
    shutil.copytree(assets / "data", node_root / "srv" / "data")
    (node_root / "srv" / "wheelhouse").mkdir(parents=True)
    for writable in ("features", "regenerated"):
        directory = node_root / "srv" / writable / HOST
        directory.mkdir(parents=True)
        shutil.chown(directory, 100000, 100000)


@dataclass
class Example:
    sim: Sim
    root: Path  # the checkout the README's commands run from
    node_root: Path  # the node's /srv lives under it

    def run(self, argv):
        return run_command(argv, self.root)

    def ct(self, command):
        return self.sim.ssh("pve1", f"/usr/sbin/pct exec {VMID} -- /bin/sh -c {shlex.quote(command)}")


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    base = tmp_path_factory.mktemp("example-inventory")
    # The node's /srv is readable by its users, the node user among them (provisioning checks each mount
    # as that user): not under pytest's directory, which only root may enter.
    node_root = Path(tempfile.mkdtemp(prefix="dflash-example-node-"))
    node_root.chmod(0o755)
    # A node with eight GPUs and none of the example's containers: its one container (CT 290, no GPUs)
    # is only the sim's, not in the copied inventory.
    sim = up(nodes=1, containers=(290,), gpus=8, gpu_passthrough={290: []}, node_user=USER,
             sudo_rule=PROVISION_RULE, state_dir=base / "state", inventory=base / "sim-hosts.yml")
    try:
        root = checkout(base / "checkout")
        copied = run_command(readme_command("cp", "inventory/production.example"), root)
        assert copied.rc == 0, copied
        node_directories(node_root, prepare_assets())
        apply_overrides(root / "inventory" / "production", sim_overrides(sim, node_root))
        yield Example(sim, root, node_root)
    finally:
        down(sim.state_dir)
        shutil.rmtree(node_root, ignore_errors=True)


def pidfile(example):
    text = example.ct("cat /var/lib/dflash/main.pid").stdout
    return json.loads(text) if text.strip() else None


def alive(example, pid):
    return example.ct(f"grep -q '^State:.*[RSD]' /proc/{int(pid)}/status").returncode == 0


def run_status(example):
    return json.loads(example.ct("cat /var/lib/dflash/runs/main/status.json").stdout)


def test_the_readme_names_every_command_this_test_runs():
    playbooks = {arg for argv in readme_lines() for arg in argv if arg.startswith("playbooks/")}
    assert {"playbooks/preflight_node.yml", "playbooks/provision.yml", "playbooks/deploy.yml",
            "playbooks/status.yml", "playbooks/restart_training.yml", "playbooks/stop_training.yml",
            "playbooks/rollback.yml", "playbooks/fetch_metrics.yml", "playbooks/export.yml",
            "playbooks/capture_features.yml"} <= playbooks, playbooks


def test_the_preflight_passes_as_the_node_user_with_the_example_s_settings(example):
    res = example.run(readme_command("ansible-playbook", "playbooks/preflight_node.yml"))
    assert res.rc == 0, res
    # The checks of the containers' own settings (the example's 200 GiB root disk on local-lvm).
    assert "PASS rootdir-storage: storage local-lvm holds container root disks" in res.stdout, res
    assert f"(needs 200, for {HOST})" in res.stdout, res


def test_provision_creates_ct200_with_its_gpus_and_mounts_and_a_second_run_changes_nothing(example):
    provision = readme_command("ansible-playbook", "playbooks/provision.yml")
    first = example.run(provision)
    assert first.rc == 0, first
    lines = example.sim.ssh("pve1", f"pct config {VMID}").stdout.splitlines()
    assert f"rootfs: local-lvm:vm-{VMID}-disk-0,size=200G" in lines, lines
    assert {f"dev{i}: /dev/nvidia{i},gid=44" for i in range(8)} <= set(lines), lines
    assert f"mp0: {example.node_root}/srv/models,mp=/srv/models,replicate=0,ro=1" in lines, lines
    assert f"mp3: {example.node_root}/srv/features/{HOST},mp=/srv/features,replicate=0" in lines, lines
    assert "features: nesting=1" in lines, lines  # unprivileged, systemd > 241 in the template
    again = example.run(provision)
    assert again.rc == 0 and again.recap[HOST]["changed"] == 0, again


def vault_user(example):
    """The controller user of the README's vault lines: a HOME with the vault password file (mode 0600)
    and an EDITOR that writes what the README says to write in the vaulted file, the token filled in."""
    home = example.root.parent / "home"
    home.mkdir(exist_ok=True)
    password = home / ".dflash-vault-pass"
    password.write_text("example vault password\n")
    password.chmod(0o600)
    editor = home / "editor.py"
    editor.write_text("import sys\nopen(sys.argv[1], 'w').write('dflash_run_secret_environment: "
                      f"{{HF_TOKEN: {SECRET}}}\\n')\n")
    return {"HOME": str(home), "EDITOR": f"{sys.executable} {editor}"}


def test_the_first_deploy_with_a_secret_starts_the_run_and_never_shows_the_secret(example):
    user = vault_user(example)
    create = readme_command("ansible-vault", "create")
    made = run_command(create, example.root, env=user, terminal=True)
    assert made.rc == 0, made
    vaulted = (example.root / "secrets.yml").read_text()
    assert vaulted.startswith("$ANSIBLE_VAULT;") and SECRET not in vaulted
    deploy = readme_command("ansible-playbook", "playbooks/deploy.yml", "-e")
    assert SECRET not in " ".join(deploy)  # nothing of the secret on the command line
    res = run_command(deploy, example.root, env=user)
    assert res.rc == 0, res
    assert SECRET not in res.stdout
    run = pidfile(example)
    assert run and alive(example, run["pid"]), run
    # The run has the secret in its environment, from a file only root reads.
    assert example.ct("stat -c %U:%a /var/lib/dflash/secrets/main.env").stdout == "root:600\n"
    environ = example.ct(f"tr '\\0' '\\n' < /proc/{run['pid']}/environ").stdout.splitlines()
    assert f"HF_TOKEN={SECRET}" in environ
    # And nowhere else in the container: not the run's log, its pidfile, its outputs or the release.
    leaks = example.ct(f"grep -rl {SECRET} /var/log/dflash /opt/dflash /var/lib/dflash/main.pid "
                       "/var/lib/dflash/runs").stdout.split()
    assert leaks == []
    # It trains the model of the node's read-only mount, from the checkout's dflash_ops/
    assert "/srv/models/tiny-demo" in example.ct("cat /opt/dflash/current/config.yaml").stdout
    assert (example.root / ".cache" / "releases").is_dir()

    again = run_command(deploy, example.root, env=user)
    assert again.rc == 0 and again.recap[HOST]["changed"] == 0, again
    assert SECRET not in again.stdout


def test_status_restart_and_stop(example):
    status = readme_command("ansible-playbook", "playbooks/status.yml")
    before = pidfile(example)
    res = example.run(status)
    assert res.rc == 0, res
    assert any(HOST in line and "running" in line and str(before["pid"]) in line
               for line in res.stdout.splitlines()), res

    res = example.run(readme_command("ansible-playbook", "playbooks/restart_training.yml"))
    assert res.rc == 0, res
    after = pidfile(example)
    assert after["pid"] != before["pid"]
    assert alive(example, after["pid"]) and not alive(example, before["pid"])

    stop = example.run(readme_command("ansible-playbook", "playbooks/stop_training.yml"))
    assert stop.rc == 0, stop
    assert not alive(example, after["pid"]) and pidfile(example) is None
    assert run_status(example)["state"] == "stopped"


def test_a_feature_cache_captured_through_the_mount_trains_the_next_deploy(example):
    """README's feature-cache path: capture into /srv/features, the node's /srv/features/ct200 mounted
    there, then a deploy that trains from it, on the node's storage."""
    # The operator's chown makes the directory the container root's on a real node, where that root is the
    # node's uid 100000; pvesim's containers are privileged (docs/PVESIM.md, the uid shift not modelled), so
    # there the container's root is the node's uid 0, and the trainer refuses a directory of another user.
    on_node = example.node_root / "srv" / "features" / HOST
    shutil.chown(on_node, 0, 0)
    res = example.run(readme_command("ansible-playbook", "playbooks/capture_features.yml"))
    assert res.rc == 0, res
    # Written in the container, kept on the node's storage.
    manifest = json.loads((on_node / "manifest.json").read_text())
    assert manifest["shards"] and all((on_node / shard["name"]).is_file() for shard in manifest["shards"])

    # The README's next step, in its words.
    assert "then deploy with -e dflash_release_features_path=/srv/features" in README.read_text()
    res = example.run(readme_deploy("-e", "dflash_release_features_path=/srv/features"))
    assert res.rc == 0, res
    run = pidfile(example)
    assert run and alive(example, run["pid"]), res
    assert "features_path: /srv/features" in example.ct("cat /opt/dflash/current/config.yaml").stdout


def test_rollback_metrics_and_an_export_land_in_the_checkout(example):
    features_release = example.ct("readlink /opt/dflash/current").stdout.strip()
    res = example.run(readme_command("ansible-playbook", "playbooks/rollback.yml"))
    assert res.rc == 0, res
    assert example.ct("readlink /opt/dflash/current").stdout.strip() != features_release
    run = pidfile(example)
    assert run and alive(example, run["pid"]), res
    assert "features_path" not in example.ct("cat /opt/dflash/current/config.yaml").stdout

    res = example.run(readme_command("ansible-playbook", "playbooks/fetch_metrics.yml"))
    assert res.rc == 0, res
    metrics = example.root / ".cache" / "metrics"
    assert (metrics / f"{HOST}.metrics.jsonl").stat().st_size > 0 and (metrics / "loss.png").is_file(), res

    res = example.run(readme_command("ansible-playbook", "playbooks/export.yml"))
    assert res.rc == 0, res
    exports = sorted((example.root / ".cache" / "exports" / HOST).glob("step-*"))
    assert exports and (exports[-1] / "model.safetensors").is_file(), res

    stop = example.run(readme_command("ansible-playbook", "playbooks/stop_training.yml"))
    assert stop.rc == 0 and not alive(example, run["pid"]), stop
