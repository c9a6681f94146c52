"""Which GPUs this process may use, without importing torch (the launcher and `validate` stay light)."""

import os
from pathlib import Path


def visible_devices() -> list[str]:
    """The GPUs this process may hand out, as CUDA_VISIBLE_DEVICES entries: its own
    CUDA_VISIBLE_DEVICES when set, else every GPU the driver exposes (/dev/nvidia0, 1, ...)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()]
    indices = sorted(int(p.name[len("nvidia"):]) for p in Path("/dev").glob("nvidia*")
                     if p.name[len("nvidia"):].isdigit())
    return [str(i) for i in indices]
