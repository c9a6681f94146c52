"""Which checkpoint an export takes, and an export that can be checked and kept: `find_checkpoint` picks
a complete checkpoint by the rule the trainer resumes by and says why there is none (no run, none yet,
not that step, one the run is still writing); `python -m dflash_ops.export --into DIR [--step N]` writes
DIR/step-<N> with a SHA256SUMS, keeps an export that still matches it, and `--plan` writes nothing."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_ops.core.config import config_from_dict
from dflash_ops.data.target import load_target
from dflash_ops.run.main import run_single_process
from dflash_ops.serve.export import MANIFEST, load_export
from dflash_ops.serve.export import main as export_main
from dflash_ops.training import checkpoint as checkpoint_module
from dflash_ops.training.checkpoint import (
    CHECKPOINT_FILES,
    CheckpointNotFoundError,
    checkpoint_name,
    find_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    saves_in_progress,
)

EXPORT_FILES = {"config.json", "model.safetensors", "modeling_dflash.py", "drafter.py", "README.md"}


def fake_checkpoint(run: Path, step: int, files=CHECKPOINT_FILES) -> Path:
    path = run / "checkpoints" / checkpoint_name(step)
    path.mkdir(parents=True)
    for name in files:
        (path / name).write_text("x")
    return path


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def refusal(path, step=None) -> str:
    with pytest.raises(CheckpointNotFoundError) as err:
        find_checkpoint(path, step)
    return str(err.value)


def test_the_latest_or_the_named_complete_checkpoint_is_the_one_the_trainer_would_resume_from(tmp_path):
    for step in (5, 10):
        fake_checkpoint(tmp_path, step)
    fake_checkpoint(tmp_path, 15, files=CHECKPOINT_FILES[:-1])  # no meta.json: not complete
    assert find_checkpoint(tmp_path) == latest_checkpoint(tmp_path) == tmp_path / "checkpoints/step-00000010"
    assert find_checkpoint(tmp_path, 5) == tmp_path / "checkpoints/step-00000005"
    # A checkpoint's own directory is the checkpoint.
    assert find_checkpoint(tmp_path / "checkpoints/step-00000005") == tmp_path / "checkpoints/step-00000005"
    assert refusal(tmp_path, 15) == (
        f"{tmp_path}/checkpoints/step-00000015 is not a complete checkpoint (no meta.json); its checkpoints "
        "are steps 5, 10 (a run keeps the latest run.keep_checkpoints)")


def test_no_run_no_checkpoint_yet_and_a_step_it_does_not_have_are_told_apart(tmp_path):
    assert refusal(tmp_path / "nowhere") == (
        f"no checkpoint at {tmp_path}/nowhere: it does not exist (neither a checkpoint's directory nor a "
        "run's output directory)")
    (tmp_path / "run").mkdir()
    assert refusal(tmp_path / "run").startswith(f"{tmp_path}/run has no complete checkpoint yet (a run saves")
    fake_checkpoint(tmp_path / "run", 5)
    assert refusal(tmp_path / "run", 7) == (
        f"{tmp_path}/run has no checkpoint of step 7; its checkpoints are steps 5 (a run keeps the latest "
        "run.keep_checkpoints)")


def test_a_step_that_a_live_process_is_saving_is_still_being_written(tmp_path):
    fake_checkpoint(tmp_path, 5)
    root = tmp_path / "checkpoints"
    (root / f".tmp-step-00000010-{os.getpid()}").mkdir()
    assert refusal(tmp_path, 10) == (
        f"the run is still writing checkpoint step 10 in {root} (.tmp-step-00000010-{os.getpid()}): ask "
        "again once it has written step-00000010, or for another step; the latest complete one is step 5")
    # The latest complete checkpoint is still there to take; one of another step says what is being written.
    assert find_checkpoint(tmp_path) == root / "step-00000005"
    assert refusal(tmp_path, 7).endswith("; the run is writing step 10 now")
    # A save whose writer is gone is a killed save's leftover, not a save in progress.
    (root / f".tmp-step-00000010-{os.getpid()}").rename(root / f".tmp-step-00000010-{dead_pid()}")
    assert saves_in_progress(tmp_path) == {}
    assert refusal(tmp_path, 10).startswith(f"{tmp_path} has no checkpoint of step 10")


@pytest.fixture
def trained_run(tiny_config, tmp_path):
    """A tiny run with checkpoints of steps 5 and 10, the temp dir the trainer saves each through seen
    while it was written (save_checkpoint's torch.save of trainer.pt happens inside it)."""
    run = tmp_path / "run"
    seen = {}
    real_save = torch.save

    def watching_save(obj, path, *args, **kwargs):
        seen[Path(path).parent.name] = saves_in_progress(run)
        return real_save(obj, path, *args, **kwargs)

    cfg = config_from_dict(tiny_config(run, optim={"total_steps": 10}))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(checkpoint_module.torch, "save", watching_save)
        assert run_single_process(cfg) == 0
    return run, seen


def test_the_trainer_s_own_saves_are_seen_in_progress(trained_run):
    run, seen = trained_run
    tmp = f".tmp-step-00000010-{os.getpid()}"
    assert seen[tmp] == {10: run / "checkpoints" / tmp}
    assert [p.name for p in checkpoint_module.list_checkpoints(run)] == ["step-00000005", "step-00000010"]


def export(capsys, *args) -> tuple[int, dict | None, str]:
    capsys.readouterr()
    rc = export_main(list(map(str, args)))
    out, err = capsys.readouterr()
    return rc, json.loads(out.splitlines()[-1]) if rc == 0 else None, err


def sha256s(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in directory.iterdir()}


def test_into_writes_the_step_s_directory_with_its_checksums_and_keeps_it_while_it_matches(
        trained_run, tiny_target, tmp_path, capsys):
    run, _ = trained_run
    exports = tmp_path / "exports"
    rc, plan, _ = export(capsys, "--checkpoint", run, "--into", exports, "--plan")
    assert rc == 0 and not exports.exists()
    assert plan == {"event": "plan", "checkpoint": str(run / "checkpoints/step-00000010"), "step": 10,
                    "out": str(exports / "step-00000010"), "dtype": "bfloat16", "exists": False, "files": {}}

    rc, report, _ = export(capsys, "--checkpoint", run, "--into", exports)
    out = exports / "step-00000010"
    assert rc == 0 and report["out"] == str(out) and report["reused"] is False
    files = sha256s(out)
    assert set(files) == EXPORT_FILES | {MANIFEST}
    manifest = (out / MANIFEST).read_text()
    order = ("config.json", "model.safetensors", "modeling_dflash.py", "drafter.py", "README.md")
    assert manifest == "".join(f"{files[name]}  {name}\n" for name in order)
    assert report["files"] == {name: files[name] for name in EXPORT_FILES}
    # dflash's own loader reads it: the checkpoint's weights, in bfloat16.
    drafter, layer_ids = load_export(out, load_target(tiny_target))
    model_state, _, meta = load_checkpoint(run / "checkpoints/step-00000010")
    assert layer_ids == meta["layer_ids"]
    exported = drafter.trainable_state_dict()
    assert set(exported) == set(model_state)
    for name, tensor in model_state.items():
        assert torch.equal(exported[name].to(torch.bfloat16), tensor.to(torch.bfloat16)), name

    # Again: the export that still matches its SHA256SUMS is kept as it is; a plan says it exists.
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    rc, again, _ = export(capsys, "--checkpoint", run, "--into", exports)
    assert rc == 0 and again["reused"] is True and again["files"] == report["files"]
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == mtimes
    rc, plan, _ = export(capsys, "--checkpoint", run, "--into", exports, "--plan")
    assert plan["exists"] is True and plan["files"] == report["files"]

    # A file changed since, or another dtype: written again.
    with open(out / "README.md", "a") as fh:
        fh.write("edited\n")
    rc, rewritten, _ = export(capsys, "--checkpoint", run, "--into", exports)
    assert rc == 0 and rewritten["reused"] is False and sha256s(out) == files
    rc, fp32, _ = export(capsys, "--checkpoint", run, "--into", exports, "--dtype", "float32")
    assert rc == 0 and fp32["reused"] is False
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"


def test_step_names_the_checkpoint_and_an_unknown_step_fails_naming_the_steps_there(trained_run, tmp_path,
                                                                                     capsys):
    run, _ = trained_run
    rc, report, _ = export(capsys, "--checkpoint", run, "--step", 5, "--into", tmp_path / "exports")
    assert rc == 0 and report["step"] == 5 and Path(report["out"]).name == "step-00000005"
    rc, _, err = export(capsys, "--checkpoint", run, "--step", 7, "--into", tmp_path / "exports")
    assert rc == 2
    assert err.strip() == (f"error: {run} has no checkpoint of step 7; its checkpoints are steps 5, 10 (a "
                           "run keeps the latest run.keep_checkpoints)")
    assert sorted(p.name for p in (tmp_path / "exports").iterdir()) == ["step-00000005"]


def test_an_export_that_did_not_finish_has_no_manifest_and_is_written_again(trained_run, tmp_path, capsys):
    run, _ = trained_run
    out = tmp_path / "exports" / "step-00000010"
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")  # what a killed export can leave: some files, no SHA256SUMS
    rc, report, _ = export(capsys, "--checkpoint", run, "--into", tmp_path / "exports")
    assert rc == 0 and report["reused"] is False
    assert set(sha256s(out)) == EXPORT_FILES | {MANIFEST}


def test_an_export_of_a_named_step_is_kept_after_the_run_removed_its_checkpoint(trained_run, tmp_path,
                                                                                capsys):
    run, _ = trained_run
    rc, first, _ = export(capsys, "--checkpoint", run, "--step", 5, "--into", tmp_path / "exports")
    assert rc == 0 and first["reused"] is False
    shutil.rmtree(run / "checkpoints" / "step-00000005")  # pruned by the run (keep_checkpoints)
    rc, kept, _ = export(capsys, "--checkpoint", run, "--step", 5, "--into", tmp_path / "exports")
    assert rc == 0 and kept["reused"] is True and kept["checkpoint"] is None
    assert kept["files"] == first["files"] and kept["out"] == first["out"]
    # Without the export, the step is gone: the trainer's sentence names what is there.
    shutil.rmtree(tmp_path / "exports")
    rc, _, err = export(capsys, "--checkpoint", run, "--step", 5, "--into", tmp_path / "exports")
    assert rc == 2 and f"{run} has no checkpoint of step 5; its checkpoints are steps 10" in err


def test_weights_the_exported_class_would_not_load_are_refused_before_anything_is_written(
        trained_run, tmp_path, capsys):
    """SGLang skips a weight name it does not know and never checks for a missing one: a misnamed export
    would serve with random weights. The export checks the names against its own class's parameters."""
    from safetensors.torch import load_file, save_file

    run, _ = trained_run
    step = tmp_path / "renamed"
    shutil.copytree(run / "checkpoints" / checkpoint_name(10), step)
    state = load_file(str(step / "model.safetensors"))
    state["final_norm.weight"] = state.pop("norm.weight")
    save_file(state, str(step / "model.safetensors"))
    rc, _, err = export(capsys, "--checkpoint", step, "--out", tmp_path / "out")
    assert rc == 2 and "missing norm.weight" in err and "final_norm.weight" in err, err
    assert not (tmp_path / "out").exists()
