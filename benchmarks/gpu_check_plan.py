"""What the GPU check runs in one call: the toolchain first, then its parts by value within a budget.

A GPU is lent for a 10-minute call on a fresh machine. Two things decide whether the call is worth it:

- the toolchain, checked before any part, in seconds: torch.compile's CUDA kernels are Triton's, and
  Triton builds its launcher with a C compiler against Python's headers the first time a kernel runs
  (triton-lang/triton, python/triton/runtime/build.py, `_build`: $CC, else gcc, else clang on PATH;
  `-O3 -shared -fPIC` with Python's include directory). Without either, the FlexAttention parts fail
  minutes in, after the parts before them; here the check names what is missing and exits 1 first;
- the order: the parts run in `ORDER`, most valuable first, and a part starts only when its estimated
  seconds (`ESTIMATED_S`) fit what is left of `--budget`; the others are reported as left out for the
  budget, not failed. Each part's seconds are recorded beside its estimate, and the results are written
  after every part, so a call cut short still returns what it measured.

The tiles row of part f (`tiles_speed`) was measured on an H200 already (46.8 s a step, BENCHMARKS.md
section 10) and costs ~4 minutes: it runs only when named in `--parts`, and then last.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

# Most valuable first: the step's pace at the recipe (what every cost is scaled from, and the >= 7
# samples/s goal), the CUDA tests (FlexAttention against the dense mask, host syncs, the fused step), the
# recipe's drafter rank (memory beside the model, the held-out evaluation on the step's backend), the
# target's capture (the other side of the split), a SIGTERM and resume on CUDA, chunked against unchunked
# loss (measured on CPU already: section 9), then the tiles. The drafter step by kind (DSpark and distilled
# DFlash beside DFlash) comes after the run's own checks: within the default budget only when they finish
# early, otherwise by name (`--parts drafter_kinds`).
ORDER = ("drafter_speed", "gpu_tests", "recipe", "target_capture", "training", "drafter_kinds",
         "drafter_step", "tiles_speed")
OFF_UNLESS_NAMED = ("tiles_speed",)
# Estimated seconds of each part on one H200 with a cold torch.compile cache (the process's imports, the
# model's build, compilation, the measured steps). Estimates from the figures of BENCHMARKS.md section 10
# (flex: 1.456 s a step, its first step 5.1 s with a warm cache; the tiles: 64 s, then ~47 s a step) until
# a run's recorded `seconds` replace them. drafter_kinds: three trainers one after another, each two
# warm-up and three measured steps (DFlash's 0.75 s, distilled 0.85 s, DSpark's 1.10 s modelled at its
# 256 anchors), the first kind's compilation cold (~60 s), the others' from its cache, the process ~15 s.
ESTIMATED_S = {"drafter_speed": 120, "gpu_tests": 150, "recipe": 90, "target_capture": 60, "training": 60,
               "drafter_kinds": 150, "drafter_step": 90, "tiles_speed": 240}
# One 10-minute call, less the machine's start and the results' copy back.
DEFAULT_BUDGET_S = 540.0


def ordered(parts) -> list[str]:
    """`parts` in the order of value."""
    return sorted(parts, key=ORDER.index)


def fits(part: str, elapsed: float, budget: float | None) -> str | None:
    """None when `part` may start `elapsed` seconds into a call of `budget` seconds (None: no budget),
    else why it is left out."""
    if budget is None or elapsed + ESTIMATED_S[part] <= budget:
        return None
    return (f"left out for the budget: ~{ESTIMATED_S[part]} s estimated, {max(0.0, budget - elapsed):.0f} s "
            f"of --budget {budget:g} left")


def find_compiler(env=os.environ) -> str | None:
    """The C compiler Triton would use: $CC, else gcc, else clang (build.py's `_build`)."""
    path = env.get("PATH", os.defpath)
    return env.get("CC") or shutil.which("gcc", path=path) or shutil.which("clang", path=path)


def python_include() -> str:
    """Python's include directory as Triton's `_build` reads it (Debian's posix_local is posix_prefix)."""
    scheme = sysconfig.get_default_scheme()
    return sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)["include"]


EXTENSION = "#include <Python.h>\nint dflash_toolchain_check(void) { return Py_IsInitialized(); }\n"


def toolchain(need_triton: bool, env=os.environ) -> dict:
    """What torch.compile's CUDA path needs, checked in seconds: Triton importable, and a C compiler that
    builds a Python extension as Triton's launcher is built. `problems` lists what is missing (with
    `need_triton` false, as on the CPU dry run, a missing Triton is noted, not a problem)."""
    found = {"compiler": find_compiler(env), "python_include": python_include(), "problems": [], "notes": []}
    spec = importlib.util.find_spec("triton")
    found["triton"] = spec.origin if spec else None
    if spec is None:
        (found["problems"] if need_triton else found["notes"]).append(
            f"Triton is not importable by {sys.executable}: torch.compile has no CUDA kernels without it "
            "(pip install the triton that torch's CUDA wheel names)")
    if found["compiler"] is None:
        found["problems"].append("no C compiler: Triton builds its launcher with $CC, else gcc, else clang "
                                 "(apt-get install gcc, or set CC)")
        return found
    with tempfile.TemporaryDirectory(prefix="gpu_check-cc-") as tmp:
        src, so = Path(tmp) / "check.c", Path(tmp) / f"check{sysconfig.get_config_var('EXT_SUFFIX')}"
        src.write_text(EXTENSION)
        cmd = [found["compiler"], str(src), "-O3", "-shared", "-fPIC", "-o", str(so),
               f"-I{found['python_include']}"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=dict(env))
            error = None if done.returncode == 0 and so.exists() else \
                f"exit {done.returncode}: {(done.stderr or done.stdout).strip()[-500:]}"
        except (OSError, subprocess.TimeoutExpired) as exc:
            error = str(exc)
    if error:
        found["problems"].append(f"{found['compiler']} cannot build a Python extension as Triton does "
                                 f"({' '.join(cmd[:1] + cmd[2:6])} -I<Python's headers>): {error} "
                                 "(Python's headers: apt-get install python3-dev)")
    return found
