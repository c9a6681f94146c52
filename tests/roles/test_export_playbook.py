"""export.yml against pvesim: a short deployed run's checkpoint, exported in its container by the live
release and copied to the controller with every file's sha256 checked; the copy is what the container
has and what dflash's own loader reads. Check mode and the refusals (no checkpoint yet, a step the run
does not have, a step it is still writing, a bad variable, a different copy on the controller) change
nothing, and the run is never touched.

The tests share one fleet (pve1, CT 200) and each makes the state it needs: a run training (a
checkpoint every run.save_every steps, the latest 2 kept) or stopped (`ensure_running`, `ensure_stopped`).
"""

import base64
import hashlib
import json
import shlex
import subprocess

import pytest
import torch
import yaml
from safetensors.torch import load as load_safetensors

from dflash_ops.data.target import load_target
from dflash_ops.serve.export import load_export
from pvesim.fleet import REPO, Fleet
from tests.reliability.input_support import shown

pytestmark = [pytest.mark.sim, pytest.mark.slow]

EXPORT_TASK = "Ensure the run's checkpoint is exported and on the controller, each file checked."
OUTPUT = "/var/lib/dflash/runs/main"
EXPORTS = "/var/lib/dflash/exports/main"  # root's, outside the output directory the run's user may own
# The sim inventory's run: a checkpoint every SAVE_EVERY steps.
SAVE_EVERY = yaml.safe_load((REPO / "inventory/sim/group_vars/training_containers.yml").read_text())[
    "dflash_release_settings"]["run"]["save_every"]
FILES = {"config.json", "model.safetensors", "modeling_dflash.py", "drafter.py", "README.md", "SHA256SUMS"}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("export-fleet"), nodes=1, containers=(200,))
    yield f
    f.down()


def running_pid(fleet):
    info = fleet.run_info(200)
    return info["pid"] if info and fleet.alive(200, info["pid"]) else None


def ensure_running(fleet):
    """A run trains in CT 200 and has saved a checkpoint; returns its pid."""
    if running_pid(fleet) is None:
        res = fleet.play("deploy.yml")
        assert res.rc == 0, res
    fleet.wait_for_checkpoint(200)
    return running_pid(fleet)


def ensure_stopped(fleet):
    """CT 200's run has saved checkpoints and stopped (its last saved as it stopped)."""
    ensure_running(fleet)
    res = fleet.play("stop_training.yml")
    assert res.rc == 0, res


def export(fleet, dest, *args):
    res = fleet.play("export.yml", "-e", f"dflash_run_export_dir={dest}", *args)
    return res, res.results(EXPORT_TASK).get("ct200")


def container_checksums(fleet, directory):
    """{path under `directory`: sha256} of every file under it in CT 200 ({} when it is missing)."""
    find = f"cd {shlex.quote(directory)} 2>/dev/null && find . -type f -exec sha256sum {{}} +"
    out = fleet.ct(200, find).stdout
    return {line.split(None, 1)[1].strip()[2:]: line.split()[0] for line in out.splitlines()}


def controller_checksums(directory):
    """{path under `directory`: sha256} of every file under it on the controller."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()} if directory.exists() else {}


def checkpoint_tensors(fleet, checkpoint):
    """The tensors of a checkpoint's model.safetensors in CT 200, read through base64."""
    text = fleet.ct(200, f"base64 -w0 {shlex.quote(checkpoint)}/model.safetensors").stdout
    return load_safetensors(base64.b64decode(text))


def test_export_copies_the_latest_checkpoint_with_the_containers_checksums_and_loads(fleet, tmp_path):
    pid = ensure_running(fleet)
    res, result = export(fleet, tmp_path)
    assert res.rc == 0, res
    step = result["step"]
    dest = tmp_path / "ct200" / f"step-{step:08d}"
    assert result["dest"] == str(dest) and result["dir"] == f"{EXPORTS}/step-{step:08d}"
    assert result["changed"] and step > 0 and step % SAVE_EVERY == 0  # a checkpoint the run saved
    # Every file of the export, each with the sha256 it has in the container; SHA256SUMS agrees.
    copied = controller_checksums(dest)
    assert set(copied) == FILES
    assert copied == container_checksums(fleet, result["dir"]) == result["files"]
    check = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=dest, capture_output=True, text=True)
    assert check.returncode == 0 and check.stdout.count(": OK") == len(FILES) - 1, check.stdout
    # dflash's own loader reads the copy, with the sim run's settings.
    drafter, layer_ids = load_export(dest, load_target(fleet.assets / "target"))
    config = json.loads((dest / "config.json").read_text())
    assert config["dflash_config"]["block_size"] == 8 and config["num_hidden_layers"] == 1
    assert config["dtype"] == "bfloat16" and layer_ids == config["dflash_config"]["target_layer_ids"]
    weights = load_safetensors((dest / "model.safetensors").read_bytes())
    loaded = drafter.trainable_state_dict()
    assert set(loaded) == set(weights)
    assert all(torch.equal(loaded[name], tensor.to(loaded[name].dtype)) for name, tensor in weights.items())
    assert running_pid(fleet) == pid  # the run went on

    # Again for that step, after the run has removed its checkpoint (it keeps 2): the export kept in the
    # container and the copy on the controller are the same, so nothing changes.
    fleet.wait_for_status(200, lambda s: s.get("step", 0) >= step + 3 * SAVE_EVERY,
                          what="two more checkpoints")
    res, again = export(fleet, tmp_path, "-e", f"dflash_run_export_step={step}")
    assert res.rc == 0, res
    assert res.stats["ct200"]["changed"] == 0 and again["exported"] is False and again["fetched"] == []
    assert controller_checksums(dest) == copied


# Under make test-reliability only (half a minute): make test keeps check mode's promise through
# test_check_mode.py's playbooks.
@pytest.mark.reliability_full
def test_check_mode_names_the_checkpoint_and_writes_nothing(fleet, tmp_path):
    pid = ensure_running(fleet)
    before = container_checksums(fleet, EXPORTS)
    res, result = export(fleet, tmp_path, "--check")
    assert res.rc == 0, res
    assert result["changed"] and result["step"] > 0
    # The latest checkpoint is newer than any export yet (the run saves every 5 s): it would be written.
    step = result["step"]
    assert f"Would write the export of step {step} of {OUTPUT} at {EXPORTS}/step-{step:08d}" in result["msg"]
    assert f"Would copy it to {tmp_path}/ct200/step-{step:08d}" in result["msg"]
    assert not tmp_path.joinpath("ct200").exists()
    assert container_checksums(fleet, EXPORTS) == before
    assert running_pid(fleet) == pid


def empty_run_dir(fleet, tmp_path):
    fleet.ct(200, "mkdir -p /var/lib/dflash/runs/fresh/checkpoints")
    return ("-e", "dflash_run_output_dir=/var/lib/dflash/runs/fresh")


def save_in_progress(fleet, tmp_path):
    """A save of step 99999990 that the running trainer is writing: its temp dir, named with its pid."""
    pid = fleet.run_info(200)["pid"]
    fleet.ct(200, f"mkdir {OUTPUT}/checkpoints/.tmp-step-99999990-{pid}")
    return ("-e", "dflash_run_export_step=99999990")


# (id, what makes the bad input -> extra arguments, what the message says)
REFUSALS = [
    ("no-checkpoint-yet", empty_run_dir,
     ("/var/lib/dflash/runs/fresh has no complete checkpoint yet", "run.save_every")),
    ("no-such-step", lambda fleet, tmp_path: ("-e", "dflash_run_export_step=7"),
     (f"{OUTPUT} has no checkpoint of step 7; its checkpoints are steps ", "run.keep_checkpoints")),
    ("step-still-written", save_in_progress,
     ("the run is still writing checkpoint step 99999990", "ask again once it has written step-99999990")),
    ("bad-variable", lambda fleet, tmp_path: ("-e", "dflash_run_export_step=latest"),
     ("dflash_run_export_step", "int", "Fix the value in the inventory")),
]


# make test runs the step still being written (the trainer's own rule); make test-reliability all four.
@pytest.mark.parametrize("make, words", [
    pytest.param(make, words, id=name,
                 marks=() if name == "step-still-written" else pytest.mark.reliability_full)
    for name, make, words in REFUSALS])
def test_a_refused_export_says_why_and_changes_nothing(fleet, tmp_path, make, words):
    pid = ensure_running(fleet)
    before = container_checksums(fleet, EXPORTS)
    try:
        res, _ = export(fleet, tmp_path / "exports", *make(fleet, tmp_path))
    finally:
        fleet.ct(200, f"rm -rf {OUTPUT}/checkpoints/.tmp-step-99999990-* /var/lib/dflash/runs/fresh")
    assert res.rc != 0
    for text in words:
        assert text in shown(res), shown(res)
    assert not (tmp_path / "exports").exists()
    assert container_checksums(fleet, EXPORTS) == before
    assert running_pid(fleet) == pid


@pytest.mark.reliability_full
def test_a_different_copy_on_the_controller_is_refused_unless_forced(fleet, tmp_path):
    ensure_running(fleet)
    res, first = export(fleet, tmp_path)
    assert res.rc == 0, res
    dest = tmp_path / "ct200" / f"step-{first['step']:08d}"
    with open(dest / "README.md", "a") as fh:
        fh.write("edited on the controller\n")
    edited = controller_checksums(dest)
    step = ("-e", f"dflash_run_export_step={first['step']}")

    res, _ = export(fleet, tmp_path, *step)
    assert res.rc != 0
    assert f"The controller has another export at {dest} (README.md differ" in res.messages()
    assert "dflash_run_export_force=true" in res.messages()
    assert controller_checksums(dest) == edited

    res, forced = export(fleet, tmp_path, *step, "-e", "dflash_run_export_force=true")
    assert res.rc == 0, res
    assert forced["changed"] and forced["exported"] is False and set(forced["fetched"]) == FILES
    assert controller_checksums(dest) == first["files"]
    assert sorted(p.name for p in (tmp_path / "ct200").iterdir()) == [dest.name]  # no staging left


# Under make test-reliability only (40 s, and a stop of the fleet's run); make test keeps which
# checkpoint an export takes through tests/dflash/serve/test_export_checkpoints.py.
@pytest.mark.reliability_full
def test_a_named_step_of_a_stopped_run_is_its_checkpoints_weights(fleet, tmp_path):
    ensure_stopped(fleet)
    steps = fleet.ct(200, f"ls {OUTPUT}/checkpoints").stdout.split()
    older = steps[0]  # not the latest: the one a named step picks
    assert len(steps) == 2 and older.startswith("step-")
    res, result = export(fleet, tmp_path, "-e", f"dflash_run_export_step={int(older[5:])}")
    assert res.rc == 0, res
    assert result["checkpoint"] == f"{OUTPUT}/checkpoints/{older}"
    exported = load_safetensors((tmp_path / "ct200" / older / "model.safetensors").read_bytes())
    trained = checkpoint_tensors(fleet, result["checkpoint"])
    assert set(exported) == set(trained)
    for name, tensor in trained.items():
        assert exported[name].dtype == torch.bfloat16
        assert torch.equal(exported[name], tensor.to(torch.bfloat16)), name
    # Nothing of the export is on the node (its filesystem is this machine's, the container's an overlay).
    assert fleet.sim.ssh("pve1", f"test -e {EXPORTS}").returncode == 1
