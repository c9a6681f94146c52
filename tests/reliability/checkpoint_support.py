"""A trainer whose checkpoint write can be caught half-way, for the checkpoint fault tests.

`python tests/reliability/checkpoint_support.py --pause-at POINT --on-save N --marker FILE --config C`
runs `python -m dflash_ops.train --config C` unchanged, except that the first save from its N-th on
that reaches POINT stops there, writes `POINT STEP` to FILE and waits until the process gets
SIGTERM or SIGINT (at most PAUSE_LIMIT_S), then goes on. The test watches FILE and sends its
signal from outside, so the signal lands inside the write at a known point; a SIGKILL there is a
crash at that point. The production code has no such hook: the pause wraps the functions
`dflash_ops.training.checkpoint` calls.

POINTS, in the order a save reaches them:
- `tmp-dir`: the private temp dir exists, empty;
- `model`: model.safetensors is written, nothing else;
- `trainer-half`: trainer.pt holds half of its bytes;
- `files-written`: every file is written, none fsynced;
- `sealed`: the temp dir is complete and fsynced, about to be renamed into place;
- `renamed`: the checkpoint is in place, its `checkpoint` event not yet logged, old ones not pruned;
- `pruning`: an old checkpoint beyond `keep_checkpoints` is half deleted (only saves that prune).
"""

from __future__ import annotations

import argparse
import io
import os
import re
import sys
import threading
from pathlib import Path

POINTS = ("tmp-dir", "model", "trainer-half", "files-written", "sealed", "renamed", "pruning")
# The points at which the new checkpoint is not yet in place: a crash there keeps the previous one.
BEFORE_RENAME = POINTS[:5]
PAUSE_LIMIT_S = 60


class SaveHooks:
    def __init__(self, pause_at: str, on_save: int, marker: Path):
        self.pause_at, self.on_save, self.marker = pause_at, on_save, marker
        self.saves = 0
        self.paused = False
        self.step: int | None = None
        self.signalled = threading.Event()

    @property
    def armed(self) -> bool:
        return self.saves >= self.on_save and not self.paused

    def pause(self, point: str) -> None:
        if not self.armed or point != self.pause_at:
            return
        self.paused = True
        tmp = self.marker.with_name(self.marker.name + ".tmp")
        tmp.write_text(f"{point} {self.step}\n")
        os.replace(tmp, self.marker)
        self.signalled.wait(PAUSE_LIMIT_S)
        with self.marker.open("a") as f:
            f.write("signalled\n" if self.signalled.is_set() else "not signalled\n")

    def install(self) -> None:
        import shutil

        import torch

        from dflash_ops.core import runtime
        from dflash_ops.training import checkpoint

        real_save_file, real_torch_save, real_fsync = checkpoint.save_file, torch.save, checkpoint.fsync_path
        real_rmtree = shutil.rmtree
        hooks = self

        def save_file(tensors, filename, *args, **kwargs):
            hooks.saves += 1
            hooks.step = int(re.search(r"step-(\d+)", filename).group(1))
            hooks.pause("tmp-dir")
            real_save_file(tensors, filename, *args, **kwargs)
            hooks.pause("model")

        def torch_save(obj, path, *args, **kwargs):
            if not hooks.armed or hooks.pause_at != "trainer-half":
                return real_torch_save(obj, path, *args, **kwargs)
            buffer = io.BytesIO()
            real_torch_save(obj, buffer, *args, **kwargs)
            data = buffer.getvalue()
            with open(path, "wb") as f:
                f.write(data[: len(data) // 2])
                f.flush()
                hooks.pause("trainer-half")
                f.write(data[len(data) // 2:])

        def fsync(path):
            path = Path(path)
            if path.name.startswith(checkpoint._TMP_PREFIX):
                hooks.pause("sealed")
            elif path.name == checkpoint.CHECKPOINT_FILES[0]:
                hooks.pause("files-written")
            elif path.name == checkpoint.CHECKPOINT_DIR:
                hooks.pause("renamed")
            real_fsync(path)

        def rmtree(path, *args, **kwargs):
            files = sorted(Path(path).glob("*")) if "pruned-" in Path(path).name else []
            if files and hooks.armed and hooks.pause_at == "pruning":
                files[0].unlink()
                hooks.pause("pruning")
            real_rmtree(path, *args, **kwargs)

        real_handle = runtime.StopSignal._handle

        def handle(self, signum, frame):
            real_handle(self, signum, frame)
            hooks.signalled.set()

        checkpoint.save_file, torch.save, checkpoint.fsync_path = save_file, torch_save, fsync
        shutil.rmtree = rmtree
        runtime.StopSignal._handle = handle


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pause-at", choices=POINTS)
    parser.add_argument("--on-save", type=int, default=1, help="which save of this process to pause")
    parser.add_argument("--marker", type=Path)
    parser.add_argument("--config", required=True)
    args = parser.parse_args(argv)
    if args.pause_at:
        SaveHooks(args.pause_at, args.on_save, args.marker).install()
    from dflash_ops.run.main import main as train_main

    return train_main(["--config", args.config])


if __name__ == "__main__":
    sys.exit(main())
