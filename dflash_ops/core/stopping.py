"""How the processes of a pipeline run end: the stop path's timeouts, and death with the parent.

Each timeout of the stop path is named once: the trainer's here, the `training_run` module's and
the `dflash_run` role's in the collection, torchrun's in torchrun. docs/PIPELINE.md, "Stopping: who
waits for what", is the table of all of them. Imports no torch: the launcher uses it.
"""

from __future__ import annotations

import ctypes
import os
import signal
from datetime import timedelta

# torchrun's --shutdown-timeout: how long torchrun gives its workers, after it forwarded them a
# signal it handles (SIGHUP, SIGQUIT; SIGTERM and SIGINT are the launcher's), before SIGKILL. When a
# worker fails, torchrun waits its own fixed 30 s for the others instead.
TORCHRUN_SHUTDOWN_TIMEOUT_S = 10
# How long the launcher, once torchrun has exited, waits for torchrun's pipes to close (the last
# worker holding them dies with torchrun).
PIPES_CLOSE_TIMEOUT_S = 10
# How long a drafter that has checkpointed and stopped keeps receiving (and dropping) what the
# targets still send, so that no target blocks in a send for ever; after an error, only a moment.
DRAIN_AFTER_STOP_S = 60
DRAIN_AFTER_ERROR_S = 1
# How long a collective (the drafters' stop vote, DDP's gradient all-reduce, a checkpoint's gather,
# a batch's send) or a worker's rendezvous waits for a peer before it fails.
PROCESS_GROUP_TIMEOUT = timedelta(minutes=10)
# How long a worker's start waits for its peers: torchrun's rendezvous, then the start's collectives
# (the data position drafter 0 broadcasts, and the held-out features target rank 0 sends drafter 0),
# which each rank reaches only after it has loaded what it needs: a target rank its model (16 GB for
# Qwen3-8B, minutes from a cold disk), a drafter its checkpoint. Nothing else runs before them.
STARTUP_TIMEOUT = timedelta(minutes=30)

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux PR_SET_PDEATHSIG)."""
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)
