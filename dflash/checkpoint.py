"""Complete, step-numbered checkpoints written atomically.

`<output_dir>/checkpoints/step-00000100/` holds `model.safetensors` (the drafter's trainable
weights), `trainer.pt` (optimizer, scheduler, data position, RNG states), `config.yaml` and
`meta.json`. Everything is written into a hidden temp dir next to it, fsynced, then renamed into
place, so an interrupted save leaves either the previous checkpoints or the complete new one.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from dflash.model import DFlashDrafter, DrafterConfig

CHECKPOINT_DIR = "checkpoints"
_PREFIX = "step-"
_TMP_PREFIX = ".tmp-"


def checkpoint_name(step: int) -> str:
    return f"{_PREFIX}{step:08d}"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(output_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir()
             if p.is_dir() and p.name.startswith(_PREFIX) and p.name[len(_PREFIX):].isdigit()
             and (p / "meta.json").is_file()]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX):]))


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def remove_partial_saves(output_dir: str | Path) -> None:
    """Delete temp dirs left by a save that a kill interrupted."""
    root = Path(output_dir) / CHECKPOINT_DIR
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(_TMP_PREFIX):
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
                    trainer_state: dict, config_yaml: str, meta: dict, keep: int) -> Path:
    """Write checkpoint `step` atomically, then delete all but the latest `keep`; return its path."""
    root = Path(output_dir) / CHECKPOINT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(step)
    tmp = root / f"{_TMP_PREFIX}{checkpoint_name(step)}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file({k: v.contiguous().cpu() for k, v in model_state.items()}, str(tmp / "model.safetensors"))
    torch.save(trainer_state, tmp / "trainer.pt")
    (tmp / "config.yaml").write_text(config_yaml)
    (tmp / "meta.json").write_text(json.dumps({**meta, "step": step}, indent=2) + "\n")
    for f in tmp.iterdir():
        _fsync(f)
    _fsync(tmp)
    if final.exists():
        # A checkpoint of this step already exists (a save after resuming at it): replace it.
        old = root / f"{_TMP_PREFIX}old-{checkpoint_name(step)}-{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    _fsync(root)
    for stale in list_checkpoints(output_dir)[:-keep]:
        shutil.rmtree(stale, ignore_errors=True)
    return final


def load_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """(model_state, trainer_state, meta) of the checkpoint at `path`."""
    path = Path(path)
    model_state = load_file(str(path / "model.safetensors"))
    trainer_state = torch.load(path / "trainer.pt", map_location="cpu", weights_only=True)
    meta = json.loads((path / "meta.json").read_text())
    return model_state, trainer_state, meta


def load_drafter(path: str | Path, target: nn.Module) -> tuple[DFlashDrafter, list[int]]:
    """The drafter saved in checkpoint `path`, around `target`'s frozen embedding and lm_head, in
    eval mode and the target's dtype and device; with the target layer ids it was trained on."""
    model_state, _, meta = load_checkpoint(path)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    drafter = DFlashDrafter(DrafterConfig(**meta["drafter_config"]), embed, head)
    drafter.load_trainable_state_dict(model_state)
    drafter.to(device=embed.weight.device, dtype=embed.weight.dtype).eval()
    return drafter, list(meta["layer_ids"])
