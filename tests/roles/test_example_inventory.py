"""inventory/production.example works as written: copied, with only what a sim must have changed (each
override in SIM_OVERRIDES, with why), it provisions CT 200 on a fresh node, deploys to that fresh
container with everything a real user passes (a secret, the bind mounts, a node user other than root),
restarts, reads the status and stops; then captures the target's features into the container's feature
cache, the node's directory mounted there, and deploys a run that trains from it. A second provision and a
second deploy change nothing, and the secret's value never appears in Ansible's output. The tests share
one sim and run in order."""

import json
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from pvesim.fleet import REPO, prepare_assets, run_playbook, snapshot_source
from pvesim.sim import NODE_PYTHON, container_hostvars, down, up

pytestmark = [pytest.mark.sim, pytest.mark.slow]

EXAMPLE = REPO / "inventory" / "production.example"
SIM_GROUP_VARS = REPO / "inventory" / "sim" / "group_vars" / "training_containers.yml"
USER = "ansible"  # the example's node user (sudoers.d/ansible_provision, which covers sudoers.d/ansible_pct)
PROVISION_RULE = EXAMPLE / "sudoers.d" / "ansible_provision"
VMID = 200  # the example's container, which the sim does not have until provision.yml creates it
SECRET = "hf_exampleInventorySecret0123456789"
SECRETS = json.dumps({"dflash_run_secret_environment": {"HF_TOKEN": SECRET}})
START_TASK = "Start the run once its GPUs are idle, and wait for its first training step."
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
        # The node is the sim's sshd for pve1 on loopback, logged in to as the sim's node user with the
        # sim's key, its host key checked against the sim's known_hosts (the example keeps checking on).
        ("hosts.yml", "pve1"): {
            "ansible_host": pve1.address, "ansible_port": pve1.port, "ansible_user": USER,
            "ansible_ssh_private_key_file": str(sim.private_key),
            "ansible_ssh_common_args":
                f"-o UserKnownHostsFile={sim.known_hosts} -o StrictHostKeyChecking=yes",
            "ansible_python_interpreter": NODE_PYTHON,
        },
        # The container is reached through that node (same address, port, user and key).
        ("hosts.yml", f"ct{VMID}"): {
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
    wheelhouse readable, the container's feature cache owned by its root (uid 100000 on the node)."""
    shutil.copytree(assets / "target", node_root / "srv" / "models" / "tiny-demo")
    shutil.copytree(assets / "data", node_root / "srv" / "data")
    (node_root / "srv" / "wheelhouse").mkdir(parents=True)
    features = node_root / "srv" / "features" / f"ct{VMID}"
    features.mkdir(parents=True)
    shutil.chown(features, 100000, 100000)


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
        inventory = base / "inventory"
        shutil.copytree(EXAMPLE, inventory)
        node_directories(node_root, prepare_assets())
        apply_overrides(inventory, sim_overrides(sim, node_root))
        src = snapshot_source(base / "src")
        yield sim, inventory, src, node_root
    finally:
        down(sim.state_dir)
        shutil.rmtree(node_root, ignore_errors=True)


def play(example, playbook, *args):
    _, inventory, src, _ = example
    return run_playbook(playbook, inventory, *args,
                        extravars={"dflash_release_source_dir": str(src / "dflash")})


def ct(example, command):
    return example[0].ssh("pve1", f"/usr/sbin/pct exec {VMID} -- /bin/sh -c {shlex.quote(command)}")


def test_the_preflight_passes_as_the_node_user_with_the_example_s_settings(example):
    res = play(example, "preflight_node.yml")
    assert res.rc == 0, res.messages()
    checklist = res.results("Show the node's checklist.")["pve1"]["msg"]
    assert "PASS rootdir-storage: storage local-lvm holds container root disks" in checklist, checklist
    assert any(line.startswith("PASS storage-room: storage local-lvm is active, ") and
               line.endswith(f"(needs 200, for ct{VMID})") for line in checklist), checklist


def test_provision_creates_ct200_with_its_gpus_and_mounts_and_a_second_run_changes_nothing(example):
    # As the node user, through sudo with the example's rule for preflight and provision.
    first = play(example, "provision.yml")
    assert first.rc == 0, first.messages()
    lines = example[0].ssh("pve1", f"pct config {VMID}").stdout.splitlines()
    assert f"rootfs: local-lvm:vm-{VMID}-disk-0,size=200G" in lines, lines
    assert {f"dev{i}: /dev/nvidia{i},gid=44" for i in range(8)} <= set(lines), lines
    assert f"mp0: {example[3]}/srv/models,mp=/srv/models,ro=1" in lines, lines
    assert f"mp3: {example[3]}/srv/features/ct{VMID},mp=/srv/features" in lines, lines
    again = play(example, "provision.yml")
    assert again.rc == 0 and again.stats[f"ct{VMID}"]["changed"] == 0, again


def test_the_first_deploy_with_a_secret_starts_the_run_and_never_shows_the_secret(example):
    res = play(example, "deploy.yml", "-vvv", "-e", SECRETS)
    assert res.rc == 0, res
    assert SECRET not in res.stdout + res.stderr
    run = res.results(START_TASK)[f"ct{VMID}"]
    assert run["changed"] and run["pid"], run
    # The run has the secret in its environment, from a file only root reads.
    assert ct(example, "stat -c %U:%a /var/lib/dflash/main.env").stdout == "root:600\n"
    environ = ct(example, f"tr '\\0' '\\n' < /proc/{run['pid']}/environ").stdout.splitlines()
    assert f"HF_TOKEN={SECRET}" in environ
    # And nowhere else in the container: not the run's log, its pidfile, its outputs or the release.
    leaks = ct(example, f"grep -rl {SECRET} /var/log/dflash /opt/dflash /var/lib/dflash/main.pid "
                        "/var/lib/dflash/runs").stdout.split()
    assert leaks == []
    # It trains the model of the node's read-only mount.
    config = ct(example, "cat /opt/dflash/current/config.yaml").stdout
    assert "/srv/models/tiny-demo" in config

    again = play(example, "deploy.yml", "-v", "-e", SECRETS)
    assert again.rc == 0 and again.stats[f"ct{VMID}"]["changed"] == 0, again
    assert SECRET not in again.stdout


def pidfile(example):
    return json.loads(ct(example, "cat /var/lib/dflash/main.pid").stdout)


def alive(example, pid):
    return ct(example, f"grep -q '^State:.*[RSD]' /proc/{int(pid)}/status").returncode == 0


def test_restart_status_and_stop(example):
    before = pidfile(example)
    res = play(example, "restart_training.yml")
    assert res.rc == 0, res
    after = pidfile(example)
    assert after["pid"] != before["pid"]
    assert alive(example, after["pid"]) and not alive(example, before["pid"])

    status = play(example, "status.yml")
    assert status.rc == 0, status
    table = next(iter(status.results("Show the fleet's runs.").values()))["msg"]
    row = next(line.split() for line in table[1:] if line.split()[0] == f"ct{VMID}")
    assert row[3] == "running" and int(row[4]) == after["pid"], table

    stop = play(example, "stop_training.yml")
    assert stop.rc == 0, stop
    assert not alive(example, after["pid"])
    assert json.loads(ct(example, "cat /var/lib/dflash/runs/main/status.json").stdout)["state"] == "stopped"


def test_a_feature_cache_captured_through_the_mount_trains_the_next_deploy(example):
    """README's feature-cache path: capture into /srv/features, the node's /srv/features/ct200 mounted
    there, then a deploy that trains from it, with the secret, on the node's storage."""
    # The operator's chown makes the directory the container root's on a real node, where that root is the
    # node's uid 100000; pvesim's containers are privileged (docs/PVESIM.md, the uid shift not modelled), so
    # there the container's root is the node's uid 0, and the trainer refuses a directory of another user.
    on_node = example[3] / "srv" / "features" / f"ct{VMID}"
    shutil.chown(on_node, 0, 0)
    res = play(example, "capture_features.yml", "-e", "dflash_capture_out=/srv/features",
               "-e", "dflash_capture_poll=2")
    assert res.rc == 0, res.messages()
    # Written in the container, kept on the node's storage.
    manifest = json.loads((on_node / "manifest.json").read_text())
    assert manifest["shards"] and all((on_node / shard["name"]).is_file() for shard in manifest["shards"])

    res = play(example, "deploy.yml", "-e", SECRETS, "-e", "dflash_release_features_path=/srv/features")
    assert res.rc == 0, res
    assert SECRET not in res.stdout
    run = res.results(START_TASK)[f"ct{VMID}"]
    assert run["changed"] and alive(example, run["pid"]), run
    assert "features_path: /srv/features" in ct(example, "cat /opt/dflash/current/config.yaml").stdout
    stop = play(example, "stop_training.yml")
    assert stop.rc == 0 and not alive(example, run["pid"]), stop
