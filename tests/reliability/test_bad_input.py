"""Bad input fails before anything running is touched, with a message that names the cause and the fix.

One fleet (pve1: CT 200 and CT 201) runs a good run in each container, deployed once for the module.
Each case of CASES applies one piece of bad input (an -e override, a broken inventory, a fault on the
node or in the container), runs the playbook, and checks what the user saw and that the good runs go
on with the same pid on the same release. docs/RELIABILITY.md's Bad input table lists the same cases.
"""

import json
import shlex
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import yaml

from pvesim.fleet import SIM_GROUP_VARS
from tests.reliability.input_support import RunSnapshot, deployed_fleet, doc_table, shown

pytestmark = [pytest.mark.sim, pytest.mark.slow]

CONTAINERS = (200, 201)
NVIDIA_SMI = "/usr/bin/nvidia-smi"
# What the real tool prints when the kernel driver is gone or does not match the user-space one.
DRIVER_ERROR = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
                "Make sure that the latest NVIDIA driver is installed and running.")


@dataclass(frozen=True)
class Case:
    """One row of the bad-input table."""

    case: str  # the "case" column of docs/RELIABILITY.md's table
    playbook: str
    args: tuple = ()
    fault: Callable | None = None  # fault(fleet, tmp_path): applies the bad input, may return more arguments
    undo: Callable | None = None  # undo(fleet): takes the fault away again
    words: tuple = ()  # what the message must say (cause and fix); the table's row says it too
    faulted: tuple = ()  # containers the fault itself stops (their run is brought back after)
    fast: bool = False  # part of `make test`'s fast subset

    @property
    def id(self):
        return "-".join(self.case.lower().replace("`", "").replace("/", " ").split()[:6])


def extra(**variables):
    return ("-e", json.dumps(variables))


def settings_with(section: str, **keys):
    """The sim's training settings with keys of one section set (an -e replaces the whole dict)."""
    group_vars = yaml.safe_load((SIM_GROUP_VARS / "training_containers.yml").read_text())
    settings = group_vars["dflash_release_settings"]
    return {**settings, section: {**settings.get(section, {}), **keys}}


def mask_token(token_id):
    return extra(dflash_release_settings=settings_with("model", mask_token_id=token_id))


def broken_vars_file(fleet, tmp_path):
    # A tab where YAML wants spaces: the classic hand edit. (In a host_vars file Ansible reports the
    # same error without naming the file; passed with -e @file it names the file and the line.)
    (tmp_path / "vars.yml").write_text("dflash_release_keep: 3\n\tdflash_run_stop_timeout: 60\n")
    return ("-e", f"@{tmp_path / 'vars.yml'}")


def no_connection_settings(fleet, tmp_path):
    def edit(data):
        del data["all"]["children"]["training_containers"]["hosts"]["ct200"]["ansible_connection"]
    fleet.inventory_override = fleet.inventory_copy(tmp_path / "inventory", edit=edit)


def own_inventory_gone(fleet):
    fleet.inventory_override = None


def hide_nvidia_smi(fleet, tmp_path):
    fleet.ct_sh(200, f"mv {NVIDIA_SMI} {NVIDIA_SMI}.saved")


def break_gpu_driver(fleet, tmp_path):
    script = f"#!/bin/sh\necho {shlex.quote(DRIVER_ERROR)}\nexit 9\n"
    fleet.ct_sh(200, f"mv {NVIDIA_SMI} {NVIDIA_SMI}.saved && printf %s {shlex.quote(script)} > {NVIDIA_SMI} "
                     f"&& chmod 755 {NVIDIA_SMI}")


def restore_nvidia_smi(fleet):
    fleet.ct_sh(200, f"mv -f {NVIDIA_SMI}.saved {NVIDIA_SMI}")


def read_only_releases(fleet, tmp_path):
    fleet.ct_sh(200, "mount --bind -o ro /opt/dflash/releases /opt/dflash/releases")


def writable_releases(fleet):
    fleet.ct_sh(200, "umount /opt/dflash/releases")


LOG = "/var/log/dflash/main.log"
ROOTS_FILE = "/etc/dflash-probe.conf"


def symlinked_log(fleet, tmp_path):
    fleet.ct_sh(200, f"printf 'kept = yes\\n' > {ROOTS_FILE} && mv {LOG} {LOG}.kept "
                     f"&& ln -s {ROOTS_FILE} {LOG}")


def log_back(fleet):
    assert fleet.read(200, ROOTS_FILE) == "kept = yes\n"  # nothing was written through the link
    fleet.ct_sh(200, f"rm -f {LOG} {ROOTS_FILE} && mv {LOG}.kept {LOG}")


def stop_ct201(fleet, tmp_path):
    fleet.node_sh(201, "pct stop 201")


def start_ct201(fleet):
    fleet.start_container(201)  # its boot starts the run again (dflash-resume)


def pct_missing(fleet, tmp_path):
    fleet.sim.hide_on_node("pve1", ["/usr/sbin/pct"])


def pct_back(fleet):
    fleet.sim.hide_on_node("pve1", [])


FEATURES = "/root/features-bad"
# A feature cache of CT 200's live release: its target, layers and data (the capture's own CLI).
CAPTURE = (f"rm -rf {FEATURES} && cd /opt/dflash/current && PYTHONPATH=/opt/dflash/current "
           f"/opt/dflash/venv/bin/python -m dflash_ops.capture --config config.yaml --out {FEATURES} "
           "--shard-mb 1 > /dev/null")
PYTHON = "/opt/dflash/venv/bin/python -c "


def cache_then(damage):
    """A fault: a feature cache in CT 200, then `damage` (a command in the container) done to it."""
    def fault(fleet, tmp_path):
        fleet.ct_sh(200, CAPTURE + (f" && {damage}" if damage else ""))
    return fault


def cache_gone(fleet):
    fleet.ct_sh(200, f"rm -rf {FEATURES}")


# What a cache captured from another target says in its manifest: another fingerprint of the weights.
OTHER_TARGET = PYTHON + shlex.quote(
    f"import json; p = '{FEATURES}/manifest.json'; m = json.load(open(p)); "
    "m['target']['weights_fingerprint'] = 'f' * 64; json.dump(m, open(p, 'w'))")
# One byte near the end of the first shard flipped in place (its size unchanged).
FLIPPED_BYTE = PYTHON + shlex.quote(
    f"f = open('{FEATURES}/shard-00000.safetensors', 'r+b'); f.seek(-100, 2); b = f.read(1); "
    "f.seek(-100, 2); f.write(bytes([b[0] ^ 255]))")
FROM_CACHE = extra(dflash_release_features_path=FEATURES)
CHECKSUMS = extra(dflash_release_settings=settings_with("data", features_verify="checksums"))

RESTART = "restart_training.yml"
CT200 = ("-l", "ct200")
CASES = [
    # The inventory and the variables: checked on the controller before any connection.
    Case("Invalid YAML in a variables file (`-e @vars.yml`)", RESTART, CT200, broken_vars_file,
         words=("YAML parsing failed: Tabs are usually invalid in YAML", "vars.yml:2:1")),
    Case("A container without the connection settings", RESTART, CT200, no_connection_settings,
         own_inventory_gone,
         words=("ct200: a training container needs ansible_connection: dflash.ops.pct_pipelined",
                'ansible_connection is "unset"')),
    Case("A `proxmox_vmid` that is not a number", RESTART, CT200 + ("-e", "proxmox_vmid=ct200"),
         words=("needs proxmox_vmid, its numeric CT id", 'proxmox_vmid is "ct200"')),
    Case("A `proxmox_node` that is not in the inventory", RESTART, CT200 + ("-e", "proxmox_node=pve9"),
         words=('proxmox_node is "pve9"', "a host of group proxmox_hosts: pve1")),
    Case("A role variable of the wrong type", RESTART, CT200 + ("-e", "dflash_run_stop_timeout=soon"),
         words=("dflash_run_stop_timeout", "int", "Fix the value in the inventory")),
    Case("A misspelt role variable", RESTART, CT200 + ("-e", "dflash_run_stop_timout=600"),
         words=("dflash_run_stop_timout is not a variable of any role", "Fix its name"), fast=True),
    Case("A run name that is not a plain file name", RESTART,
         CT200 + ("-e", "dflash_run_name=../../../etc/cron.d/evil"),
         words=('dflash_run_name is "../../../etc/cron.d/evil"', "must be a plain file name", "Fix it")),
    Case("A relative path in the container", RESTART, CT200 + ("-e", "dflash_release_root=opt/dflash"),
         words=('dflash_release_root is "opt/dflash"', "is not an absolute path",
                "a path that starts with /")),
    # The node: checked on the node (and in the container through pct) before the container is touched.
    Case("A `proxmox_vmid` that does not exist on the node", RESTART, CT200 + ("-e", "proxmox_vmid=299"),
         words=("CT 299 does not exist on node pve1", "Fix proxmox_vmid", "the node has 200, 201")),
    Case("A stopped container", "deploy.yml", (), stop_ct201, start_ct201, faulted=(201,),
         words=("CT 201 on node pve1 is not running", "pct start 201")),
    Case("`pct` missing on the node", RESTART, CT200, pct_missing, pct_back,
         words=("/usr/sbin/pct is missing on node pve1", "Is it a Proxmox VE node")),
    Case("`nvidia-smi` missing in the container", RESTART, CT200, hide_nvidia_smi, restore_nvidia_smi,
         words=("nvidia-smi is missing in CT 200", "Install the NVIDIA driver's user-space tools")),
    Case("`nvidia-smi` failing with a driver error", RESTART, CT200, break_gpu_driver, restore_nvidia_smi,
         words=("nvidia-smi fails in CT 200", "couldn't communicate with the NVIDIA driver",
                "Check the driver"),
         fast=True),
    Case("A GPU layout beyond the container's GPUs", RESTART,
         CT200 + extra(dflash_release_device="cuda", dflash_release_target_gpus=[0, 1, 2, 3, 4],
                       dflash_release_drafter_gpus=[5, 6, 7, 8]),
         words=("CT 200 on node pve1 has 4 GPU(s)", "names GPU(s) [4, 5, 6, 7, 8]", "Fix the layout")),
    # The release: validated in the container by the trainer before the switch; the trainer names the key
    # (validate --json), the role the inventory variable that sets it.
    Case("Target and drafter GPU lists that overlap", RESTART,
         CT200 + extra(dflash_release_device="cuda", dflash_release_target_gpus=[0, 1, 2],
                       dflash_release_drafter_gpus=[2, 3]),
         words=("pipeline.drafter_gpus: shares GPUs [2] with target_gpus",
                "list it in one of the two lists only", "Fix dflash_release_drafter_gpus"), fast=True),
    Case("An unknown key in the training config", RESTART,
         CT200 + extra(dflash_release_settings={"run": {"save_evry": 10}}),
         words=("run: unknown key(s) save_evry", "Fix dflash_release_settings.run")),
    Case("A wrong type in the training config", RESTART,
         CT200 + extra(dflash_release_settings={"data": {"batch_size": "four"}}),
         words=("data.batch_size: expected int, got 'four'", "Fix dflash_release_settings.data.batch_size")),
    # The demo target's generation_config.json has eos_token_id 0 and pad_token_id 1; its embedding 384 rows.
    Case("A mask token id equal to the target's eos", RESTART, CT200 + mask_token(0),
         words=("model.mask_token_id: 0 is the target's generation_config.json eos_token_id",
                "a block pre-filled with it stops generation",
                "Fix dflash_release_settings.model.mask_token_id")),
    Case("A mask token id equal to the target's pad", RESTART, CT200 + mask_token(1),
         words=("model.mask_token_id: 1 is the target's generation_config.json pad_token_id",
                "a reserved embedding row", "Fix dflash_release_settings.model.mask_token_id")),
    Case("A mask token id outside the target's embedding", RESTART, CT200 + mask_token(384),
         words=("model.mask_token_id: 384 is outside the target's embedding (ids 0..383)",
                "Fix dflash_release_settings.model.mask_token_id")),
    Case("A negative restart limit", RESTART, CT200 + ("-e", "dflash_run_max_restarts=-1"),
         words=("pipeline.max_restarts: must be >= 0", "Fix dflash_run_max_restarts")),
    Case("A missing target model path", RESTART,
         CT200 + ("-e", "dflash_release_target_path=/srv/models/missing"),
         words=("model.target_path: no model at '/srv/models/missing'", "Fix dflash_release_target_path")),
    Case("A missing training data file", RESTART,
         CT200 + ("-e", "dflash_release_data_path=/srv/data/missing.jsonl"),
         words=("data.path: no file at '/srv/data/missing.jsonl'", "Fix dflash_release_data_path")),
    Case("A feature cache of another target", RESTART, CT200 + FROM_CACHE, cache_then(OTHER_TARGET),
         cache_gone,
         words=("data.features_path: /root/features-bad holds features of another target",
                "python -m dflash_ops.capture", "Fix dflash_release_features_path")),
    Case("A feature cache of other layer ids", RESTART,
         CT200 + extra(dflash_release_features_path=FEATURES,
                       dflash_release_settings={"model": {"target_layer_ids": [0]}}),
         cache_then(""), cache_gone,
         words=("model.target_layer_ids: /root/features-bad holds features of target layers [1], "
                "this run's is [0]",
                "Fix dflash_release_settings.model.target_layer_ids")),
    Case("A corrupt shard of a feature cache", RESTART,
         CT200 + FROM_CACHE + CHECKSUMS,
         cache_then(FLIPPED_BYTE),
         cache_gone,
         words=("shard-00000.safetensors is corrupt: its sha256 is", "run python -m dflash_ops.capture again",
                "Fix dflash_release_features_path"), fast=True),
    Case("A feature cache without its manifest", RESTART, CT200 + FROM_CACHE,
         cache_then(f"rm {FEATURES}/manifest.json"), cache_gone,
         words=("no manifest.json in /root/features-bad: the capture there has not finished",
                "Fix dflash_release_features_path")),
    Case("A run's log replaced by a symbolic link", RESTART, CT200, symlinked_log, log_back,
         words=(f"log_path {LOG} is a symbolic link (to {ROOTS_FILE})", "nothing was signalled or started",
                "Check who changed it")),
    Case("An unwritable release directory", RESTART,
         CT200 + ("-e", "dflash_release_output_dir=/var/lib/dflash/runs/b"),
         read_only_releases,
         writable_releases,
         words=("/opt/dflash/releases", "Read-only file system", "The container cannot write there")),
]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    yield from deployed_fleet(tmp_path_factory.mktemp("bad-input"), nodes=1, containers=CONTAINERS)


def as_param(case):
    return pytest.param(case, id=case.id, marks=() if case.fast else pytest.mark.reliability_full)


@pytest.mark.parametrize("case", [as_param(c) for c in CASES])
def test_bad_input_fails_clearly_and_leaves_the_runs_alone(fleet, case, tmp_path):
    before = {vmid: RunSnapshot.take(fleet, vmid) for vmid in CONTAINERS}
    assert all(snapshot.alive for snapshot in before.values()), before
    try:
        more = case.fault(fleet, tmp_path) if case.fault else ()
        res = fleet.play(case.playbook, *case.args, *(more or ()))
    finally:
        if case.undo:
            case.undo(fleet)
    message = shown(res)
    assert res.rc != 0, str(res)
    for words in case.words:
        assert words in message, f"{words!r} not in what the user saw:\n{message}"
    for vmid in CONTAINERS:
        if vmid not in case.faulted:
            assert RunSnapshot.take(fleet, vmid) == before[vmid], f"CT {vmid}'s run was touched"
    # Nothing half-done: once the fault is gone, a deploy brings a stopped run back and changes nothing else.
    if case.faulted:
        res = fleet.play("deploy.yml")
        assert res.rc == 0, str(res)
        for vmid in case.faulted:
            assert RunSnapshot.take(fleet, vmid).alive


# A pidfile that is not JSON is stale, not an error: moved aside, reported, nothing signalled, and the
# start proceeds (training_run's contract). The run died while the pidfile was being written.
GARBAGE = Case("A garbage pidfile", "deploy.yml", CT200, words=("unreadable",))
PIDFILE = "/var/lib/dflash/main.pid"
TRUNCATED = '{"pid": 12'


@pytest.mark.reliability_full
def test_a_garbage_pidfile_is_moved_aside_and_the_start_proceeds(fleet):
    before = RunSnapshot.take(fleet, 200)
    res = fleet.play("stop_training.yml", *GARBAGE.args)
    assert res.rc == 0, str(res)
    assert not fleet.alive(200, before.pid)
    fleet.ct_sh(200, f"printf %s '{TRUNCATED}' > {PIDFILE}")

    res = fleet.play(GARBAGE.playbook, *GARBAGE.args)
    assert res.rc == 0, str(res)
    reported = [r.get("msg", "") for _, _, r in res.host_results() if "unreadable" in str(r.get("msg", ""))]
    assert reported, "no task reported the unreadable pidfile"
    after = RunSnapshot.take(fleet, 200)
    assert after.alive and after.pid != before.pid and after.release == before.release
    moved = fleet.ct_sh(200, f"ls {PIDFILE}.unreadable-*").split()
    assert len(moved) == 1 and fleet.read(200, moved[0]) == TRUNCATED


def test_the_reliability_doc_table_shows_every_case_as_the_tests_see_it():
    rows = {row[0]: row for row in doc_table("## Bad input", first_column="case")}
    assert list(rows) == [case.case for case in CASES + [GARBAGE]]
    for case in CASES + [GARBAGE]:
        seen = rows[case.case][1].replace("`", "")
        for words in case.words:
            assert words in seen, f"docs/RELIABILITY.md row {case.case!r} does not say {words!r}"
