"""Where torch.compile keeps what it compiled: a directory that outlives the process, its restarts and
the release it ran from.

Inductor reads `TORCHINDUCTOR_CACHE_DIR` (default: `/tmp/torchinductor_<user>`) and Triton
`TRITON_CACHE_DIR` (default: `~/.triton/cache`); a container's /tmp may not outlive a reboot and
neither is chosen by the deployment. The run's output directory is (`run.output_dir`, under
/var/lib/dflash/runs/ in the dflash_release role, outside /opt/dflash/releases/<id>/, which a release
switch replaces): the cache goes to `<output_dir>/compile-cache/{inductor,triton}`, so a restart or a
new release compiles warm (the first step's time, `first_step_seconds`, says which). A user's own
setting of either variable is kept. The directory is the owner's alone (0700): what is in it is code the
run loads. `--fresh` moves it aside with the run, and the next run compiles cold. Imports no torch.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR = "compile-cache"
CACHE_VARIABLES = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}


def compile_cache_environment(output_dir: str | Path, environ, create: bool = False) -> dict[str, str]:
    """The compile cache variables that `environ` does not set, pointing under `output_dir`; with `create`
    (a run that compiles: on CUDA) its directories are made, the owner's alone."""
    root = Path(output_dir) / CACHE_DIR
    wanted = {name: str(root / sub) for name, sub in CACHE_VARIABLES.items() if not environ.get(name)}
    if create and wanted:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(root, 0o700)
        for path in wanted.values():
            Path(path).mkdir(mode=0o700, exist_ok=True)
    return wanted
