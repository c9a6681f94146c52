"""Complete, step-numbered checkpoints written atomically.

`<output_dir>/checkpoints/step-00000100/` holds `model.safetensors` (the drafter's trainable
weights), `trainer.pt` (optimizer, scheduler, data position, RNG states), `config.yaml` and
`meta.json`. Everything is written into a hidden temp dir next to it (mode 0700 while it is being
written), fsynced, then renamed into place, so an interrupted save leaves either the previous
checkpoints or the complete new one; the temp dir it leaves is removed by the next run. Old
checkpoints are renamed aside before they are deleted, so a kill during the deletion never leaves a
partial `step-*` dir. Checkpoints are never writable by group or other users (dirs 0755, files 0644,
less what the umask removes), whatever the umask the run was started with.
"""

from __future__ import annotations

import errno
import json
import math
import os
import random
import shutil
import time
from fractions import Fraction
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file, save_file
from torch import nn

from dflash_ops.core.config import ConfigError
from dflash_ops.core.files import fsync_path
from dflash_ops.core.runtime import DIR_MODE, FILE_MODE, ensure_dir, output_mode, readable
from dflash_ops.core.safe_paths import check_directory
from dflash_ops.model.drafter import DFlashDrafter, DrafterConfig
from dflash_ops.model.dspark import DSparkDrafter

CHECKPOINT_DIR = "checkpoints"
_PREFIX = "step-"
_TMP_PREFIX = ".tmp-"
# A checkpoint moved aside while a new save of the same step replaces it.
_REPLACED_PREFIX = f"{_TMP_PREFIX}old-"
CHECKPOINT_FILES = ("model.safetensors", "trainer.pt", "config.yaml", "meta.json")


def checkpoint_name(step: int) -> str:
    return f"{_PREFIX}{step:08d}"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(output_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    # A symbolic link is never a checkpoint: the run wrote none, and it could name anything.
    found = [p for p in root.iterdir()
             if p.is_dir() and not p.is_symlink() and p.name.startswith(_PREFIX)
             and p.name[len(_PREFIX):].isdigit() and all((p / name).is_file() for name in CHECKPOINT_FILES)]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX):]))


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def step_of(checkpoint: Path) -> int:
    return int(checkpoint.name[len(_PREFIX):])


def saves_in_progress(output_dir: str | Path) -> dict[int, Path]:
    """Step -> the temp dir of a save that a live process is writing now (a new checkpoint, or the
    replacement of one of that step). A temp dir whose writer is gone is a killed save's leftover."""
    root = Path(output_dir) / CHECKPOINT_DIR
    found = {}
    for p in sorted(root.iterdir()) if root.is_dir() else []:
        if not p.name.startswith(_TMP_PREFIX):
            continue
        prefix = _REPLACED_PREFIX if p.name.startswith(_REPLACED_PREFIX) else _TMP_PREFIX
        stem, _, pid = p.name[len(prefix):].rpartition("-")  # step-00000100-<pid of the writer>
        digits = stem[len(_PREFIX):]
        if stem.startswith(_PREFIX) and digits.isdigit() and pid.isdigit() and Path(f"/proc/{pid}").exists():
            found[int(digits)] = p
    return found


class CheckpointNotFoundError(FileNotFoundError):
    """No complete checkpoint answers the request; the message says why and what to do."""


def find_checkpoint(path: str | Path, step: int | None = None) -> Path:
    """The checkpoint at `path`: `path` itself when it is a checkpoint's directory (and no `step` is
    asked), else the complete checkpoint of `step` (by default the latest) in the run's output dir
    `path`, by the rule the trainer resumes by (`list_checkpoints`). CheckpointNotFoundError says
    why there is none: no run there, no checkpoint yet, none of that step, or the run still writes it."""
    path = Path(path)
    if step is None and (path / "model.safetensors").is_file():
        return path
    found = {step_of(p): p for p in list_checkpoints(path)}
    if found and (step is None or step in found):
        return found[max(found) if step is None else step]
    if not path.is_dir():
        raise CheckpointNotFoundError(f"no checkpoint at {path}: it does not exist (neither a checkpoint's "
                                      "directory nor a run's output directory)")
    writing, root = saves_in_progress(path), path / CHECKPOINT_DIR
    if step in writing:
        latest = f"the latest complete one is step {max(found)}" if found else "there is no complete one yet"
        raise CheckpointNotFoundError(
            f"the run is still writing checkpoint step {step} in {root} ({writing[step].name}): ask again "
            f"once it has written {checkpoint_name(step)}, or for another step; {latest}")
    now = f"; the run is writing step {max(writing)} now" if writing else ""
    if not found:
        raise CheckpointNotFoundError(f"{path} has no complete checkpoint yet (a run saves one every "
                                      f"run.save_every steps and when it is stopped){now}")
    partial = root / checkpoint_name(step)
    lacking = [name for name in CHECKPOINT_FILES if not (partial / name).is_file()]
    why = (f"{partial} is not a complete checkpoint (no {', '.join(lacking)})" if partial.is_dir()
           else f"{path} has no checkpoint of step {step}")
    raise CheckpointNotFoundError(f"{why}; its checkpoints are steps {', '.join(map(str, sorted(found)))} "
                                  f"(a run keeps the latest run.keep_checkpoints){now}")


def check_fresh_start(output_dir: str | Path, resume: bool) -> None:
    """A run that does not resume (`run.resume: false`) never starts beside another run's checkpoints: it
    would write its own among them, the latest of which are the other run's (what a resume, an export and
    status.json would take). ConfigError names the directory and the ways out."""
    found = [] if resume else list_checkpoints(output_dir)
    if found:
        listed = ", ".join(str(step_of(p)) for p in found)
        raise ConfigError("run.resume", f"false, but {Path(output_dir) / CHECKPOINT_DIR} holds another run's "
                          f"checkpoints (steps {listed}): a new run there would write beside them; point "
                          "run.output_dir at a new directory, start with --fresh (the old run is moved "
                          "aside, nothing is deleted), or set run.resume: true to continue it")


def move_run_aside(output_dir: str | Path) -> Path | None:
    """`--fresh`: the run in `output_dir`, whole (checkpoints, status.json, logs), renamed to a sibling
    `<name>.previous-<UTC time>`, which is returned; None when there is nothing there. Nothing is deleted.
    A run still live there (its status.json's process, or a save in progress) is refused."""
    path = Path(output_dir)
    if not path.is_dir() or not any(p.name != "train.lock" for p in path.iterdir()):  # run_lock's file
        return None
    check_directory(path)
    try:
        status = json.loads((path / "status.json").read_text())
    except (OSError, ValueError):
        status = {}
    pid = status.get("pid") if isinstance(status, dict) else None
    if status.get("state") in ("starting", "running", "stopping") and isinstance(pid, int) \
            and Path(f"/proc/{pid}").exists():
        raise ConfigError("run.output_dir", f"the run in {path} is {status['state']} (pid {pid}, its "
                          "status.json): stop it before starting afresh there")
    writing = saves_in_progress(path)
    if writing:
        raise ConfigError("run.output_dir", f"a live process is writing checkpoint step {max(writing)} in "
                          f"{path / CHECKPOINT_DIR}: stop that run before starting afresh there")
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside = path.with_name(f"{path.name}.previous-{stamp}")
    n = 1
    while os.path.lexists(aside):
        n += 1
        aside = path.with_name(f"{path.name}.previous-{stamp}-{n}")
    path.rename(aside)
    return aside


def remove_partial_saves(output_dir: str | Path) -> None:
    """Delete temp dirs left by a save that a kill interrupted. A complete checkpoint that a kill
    caught after it was moved aside and before its replacement was renamed in goes back in place.
    Called before a run resumes: a checkpoint directory that is a symbolic link or another user's
    raises UnsafePath (nothing is deleted, nothing resumed from there)."""
    root = Path(output_dir) / CHECKPOINT_DIR
    if not os.path.lexists(root):
        return
    check_directory(root)
    for p in sorted(root.iterdir()):
        if not p.name.startswith(_TMP_PREFIX):
            continue
        if p.name.startswith(_REPLACED_PREFIX):
            original = root / p.name[len(_REPLACED_PREFIX):].rsplit("-", 1)[0]
            if not original.exists() and all((p / name).is_file() for name in CHECKPOINT_FILES):
                p.rename(original)
                continue
        shutil.rmtree(p, ignore_errors=True)


def rng_state() -> dict:
    """The process-wide RNG states (python, torch CPU, and CUDA when present)."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(output_dir: str | Path, step: int, model_state: dict[str, torch.Tensor],
                    trainer_state: dict, config_yaml: str, meta: dict, keep: int,
                    spare: int | None = None) -> Path:
    """Write checkpoint `step` atomically, then delete all but the latest `keep` of the checkpoints up to
    `step` (never one of a later step, nor that of step `spare`: run.keep_best's); return its path. A save
    that fails (OSError: a full disk) removes what it wrote and raises; the earlier checkpoints stay."""
    root = ensure_dir(Path(output_dir) / CHECKPOINT_DIR)
    tmp = root / f"{_TMP_PREFIX}{checkpoint_name(step)}-{os.getpid()}"
    try:
        final = _write_checkpoint(root, tmp, step, model_state, trainer_state, config_yaml, meta)
    except Exception as exc:
        full = _disk_full(root)
        shutil.rmtree(tmp, ignore_errors=True)  # its space back, for the run to go on
        if isinstance(exc, OSError):
            raise
        if full:  # torch and safetensors report a failed write in words of their own
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp)) from exc
        raise
    # Only this run's lineage is pruned: the checkpoints of this step and earlier ones. A checkpoint of a
    # later step is not this run's (another run's, newer than this one's start): it is never deleted.
    lineage = [p for p in list_checkpoints(output_dir) if step_of(p) <= step]
    for stale in [p for p in lineage[:-keep] if step_of(p) != spare]:
        doomed = root / f"{_TMP_PREFIX}pruned-{stale.name}-{os.getpid()}"
        stale.rename(doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    return final


def _disk_full(path: Path) -> bool:
    """Whether the filesystem of `path` has (almost) no room left: why a save failed half-way."""
    try:
        info = os.statvfs(path)
    except OSError:
        return False
    return info.f_bavail * info.f_frsize < 2**20


def _write_checkpoint(root: Path, tmp: Path, step: int, model_state: dict[str, torch.Tensor],
                      trainer_state: dict, config_yaml: str, meta: dict) -> Path:
    final = root / checkpoint_name(step)
    shutil.rmtree(tmp, ignore_errors=True)
    # Private while it is written: no other user can open a file in it before its mode is final.
    tmp.mkdir(mode=0o700)
    save_file({k: v.contiguous().cpu() for k, v in model_state.items()}, str(tmp / "model.safetensors"))
    torch.save(trainer_state, tmp / "trainer.pt")
    (tmp / "config.yaml").write_text(config_yaml)
    (tmp / "meta.json").write_text(json.dumps({**meta, "step": step}, indent=2) + "\n")
    for name in CHECKPOINT_FILES:
        os.chmod(tmp / name, output_mode(FILE_MODE))
        fsync_path(tmp / name)
    os.chmod(tmp, output_mode(DIR_MODE))
    fsync_path(tmp)
    if final.exists():
        # A checkpoint of this step already exists (a save after resuming at it): replace it.
        old = root / f"{_REPLACED_PREFIX}{checkpoint_name(step)}-{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    fsync_path(root)
    return final


def load_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """(model_state, trainer_state, meta) of the checkpoint at `path`."""
    path = Path(path)
    model_state = load_file(readable(path / "model.safetensors"))
    trainer_state = torch.load(path / "trainer.pt", map_location="cpu", weights_only=True)
    meta = json.loads((path / "meta.json").read_text())
    return model_state, trainer_state, meta


def fit_to_checkpoint(drafter_cfg: DrafterConfig, meta: dict, configured_mask: int | None) -> None:
    """Make a drafter rebuilt from the run's config (`drafter_cfg`, changed in place) the one the
    checkpoint with `meta` trained. It takes the checkpoint's mask token: the default has changed
    over time, and the weights only work with the mask they learnt; a configured mask
    (`configured_mask`, model.mask_token_id) other than the checkpoint's is refused. Its layer types
    and sliding window must be the checkpoint's (the weights learnt to attend that way; a checkpoint
    from before they existed has full attention layers only)."""
    trained = meta.get("drafter_config", {})
    mask = trained.get("mask_token_id")
    if mask is not None and mask != drafter_cfg.mask_token_id:
        if configured_mask is not None:
            raise ConfigError("model.mask_token_id", f"{configured_mask} differs from {mask}, the mask "
                              "token the checkpoint was trained with; set it to null (or the checkpoint's) "
                              "to resume, or train from scratch in another run.output_dir")
        drafter_cfg.mask_token_id = mask
    layers = trained.get("num_layers", drafter_cfg.num_layers)
    if layers != drafter_cfg.num_layers:
        return  # the weights cannot load: loading them says so, naming the layers
    attention = {"layer_types": trained.get("layer_types") or ["full_attention"] * layers,
                 "sliding_window": trained.get("sliding_window")}
    for key, value in attention.items():
        if getattr(drafter_cfg, key) != value:
            raise ConfigError(f"model.{key}", f"{getattr(drafter_cfg, key)!r} differs from {value!r}, what "
                              "the checkpoint was trained with; set it to the checkpoint's to resume, or "
                              "train from scratch in another run.output_dir")


def check_loss_weighting(configured: dict, meta: dict) -> None:
    """Refuse to resume a checkpoint under another loss weighting (`optim.loss_weighting`, its gamma or
    dpace_alpha) than the one it was trained with: the optimizer's state and the schedule belong to that
    objective. A checkpoint from before the key trained with the decay (its gamma unrecorded)."""
    trained = meta.get("loss_weighting") or {"loss_weighting": "decay"}
    for key, value in trained.items():
        if configured.get(key) != value:
            raise ConfigError(f"optim.{key}", f"{configured.get(key)!r} differs from {value!r}, what the "
                              "checkpoint was trained with; set it to the checkpoint's to resume, or train "
                              "from scratch in another run.output_dir")


def examples_taken(meta: dict) -> int:
    """The examples the checkpoint's run has taken from its data order (epochs x examples + cursor):
    its `data_position`, or for a checkpoint from before that field, step x drafters x accumulate x
    batch_size of its step plan (the order makes no short batch, so that is exact)."""
    position = meta.get("data_position")
    if position is not None:
        return position["epoch"] * position["num_examples"] + position["cursor"]
    plan = meta["step_plan"]
    return meta["step"] * plan["drafters"] * plan.get("accumulate", 1) * plan["batch_size"]


def epoch_steps_left(cfg, taken: int) -> int:
    """The steps of `cfg`'s layout (data.batch_size x drafters x optim.accumulate rows each) that train
    what its optim.epochs have left once `taken` examples of the data order are trained."""
    left = Fraction(repr(float(cfg.optim.epochs))) * cfg.examples - taken
    return max(0, math.ceil(left / (cfg.data.batch_size * cfg.drafters * cfg.optim.accumulate)))


def check_step_plan(cfg, meta: dict) -> int | None:
    """The steps a resumed run of `optim.epochs` (`cfg`, a TrainConfig) takes in all, None for a run of
    optim.total_steps (its count is the config's). Elastic: under another number of drafters (or targets,
    or optim.accumulate) the run goes on to the end of its epochs, the checkpoint's step plus the steps
    that train what they have left (`epoch_steps_left`; the same count as before when nothing changed),
    and the schedule is rebuilt over that count. Other epochs, examples or batch size would move the end
    of the run's data and jump the schedule mid-run: refused, naming the optim.total_steps that trains
    what the epochs have left when the data is the same."""
    trained = meta.get("step_plan")
    if cfg.optim.epochs is None or trained is None:
        return None
    now = cfg.step_plan
    taken = examples_taken(meta)
    if all(now[key] == trained.get(key) for key in ("epochs", "examples", "batch_size")):
        return meta["step"] + epoch_steps_left(cfg, taken)

    def plan(p: dict) -> str:
        epochs = "optim.total_steps" if p.get("epochs") is None else f"{p['epochs']} epochs"
        examples = "" if p.get("examples") is None else f" of {p['examples']} examples"
        return (f"{p['total_steps']} steps ({epochs}{examples}, batch {p['batch_size']} x "
                f"{p['drafters']} drafters)")

    said = f"derives {plan(now)}, the checkpoint's run was {plan(trained)}: the schedule would change mid-run"
    if now["examples"] != trained.get("examples"):
        raise ConfigError("optim.epochs", f"{said}, and its data order goes on over the "
                          f"{trained.get('examples')} examples it was trained on only; set data.path (and "
                          "data.min_loss_tokens) back to resume it, or train from scratch in another "
                          "run.output_dir")
    total = meta["step"] + epoch_steps_left(cfg, taken)
    raise ConfigError("optim.epochs", f"{said}; set optim.epochs and data.batch_size back to resume it "
                      "(other numbers of drafters or targets resume as they are), or set optim.total_steps "
                      f"to {total} (and optim.epochs to null): that trains what {cfg.optim.epochs} epochs "
                      f"have left after the {taken} examples trained, at this config's batch; or train from "
                      "scratch in another run.output_dir")


def new_drafter(drafter_cfg: DrafterConfig, embed: nn.Embedding, head: nn.Linear, dspark: dict | None = None
                ) -> DFlashDrafter:
    """A drafter around the target's `embed` and `head`: the one place that picks its class. `dspark`
    (`dspark_args`' or `dflash_ops.serve.export.export_dspark_args`' answer: markov_rank, confidence_head,
    confidence_with_markov) makes it a `DSparkDrafter` with those heads; None a `DFlashDrafter`."""
    if dspark is None:
        return DFlashDrafter(drafter_cfg, embed, head)
    return DSparkDrafter(drafter_cfg, embed, head, **dspark)


def dspark_args(model: dict) -> dict | None:
    """The DSpark heads of a config's `model` section (a dict, as a checkpoint's config.yaml holds it), as
    `trainer.build_drafter` builds them; None for a DFlash drafter (model.kind dflash, or no kind: a
    checkpoint from before DSpark)."""
    if model.get("kind", "dflash") != "dspark":
        return None
    return {"markov_rank": model["markov_rank"], "confidence_head": bool(model.get("confidence_head")),
            "confidence_with_markov": True}


def checkpoint_dspark_args(path: str | Path) -> dict | None:
    """`dspark_args` of the checkpoint at `path` (its config.yaml's model section)."""
    return dspark_args((yaml.safe_load((Path(path) / "config.yaml").read_text()) or {}).get("model") or {})


def load_drafter(path: str | Path, target: nn.Module) -> tuple[DFlashDrafter, list[int]]:
    """The drafter saved in checkpoint `path` (a DSparkDrafter when its config.yaml's model.kind is dspark),
    around `target`'s frozen embedding and lm_head, in eval mode and the target's dtype and device; with
    the target layer ids it was trained on."""
    model_state, _, meta = load_checkpoint(path)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    drafter = new_drafter(DrafterConfig(**meta["drafter_config"]), embed, head, checkpoint_dspark_args(path))
    drafter.load_trainable_state_dict(model_state)
    drafter.to(device=embed.weight.device, dtype=embed.weight.dtype).eval()
    return drafter, list(meta["layer_ids"])
