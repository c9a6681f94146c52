"""Whether this venv's torch suits the machine's NVIDIA driver, without importing torch.

The rule is NVIDIA's CUDA Compatibility guide (docs.nvidia.com/deploy/cuda-compatibility): a CUDA runtime
runs on a driver that supports its CUDA version; since CUDA 11, a runtime of a newer minor version of the
same major runs too ("minor version compatibility", without PTX JIT compilation); a newer major does not
(cudaErrorInsufficientDriver, "CUDA driver version is insufficient for CUDA runtime version"). torch's CUDA
wheels bundle their runtime, whose version is `torch.version.cuda` (None in a CPU build); it is read from
torch's generated `torch/version.py`, so the check costs no torch import. The driver's CUDA version is the
"CUDA Version" that `nvidia-smi -q` prints (and the header of plain `nvidia-smi`)."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
from pathlib import Path

NVIDIA_SMI_REPORT = ["nvidia-smi", "-q"]
WHEELHOUSE_DOC = 'docs/OPERATIONS.md, "The wheelhouse"'
_CUDA = re.compile(r"^\s*CUDA Version\s*:\s*(\d+)\.(\d+)\s*$", re.M)
_DRIVER = re.compile(r"^\s*Driver Version\s*:\s*(\S+)\s*$", re.M)


def torch_build(version_file: Path | None = None) -> tuple[str, str | None] | None:
    """(torch's version, the CUDA version it was built for or None) from `version_file` (default: the
    installed torch's `version.py`); None when there is no torch to read."""
    if version_file is None:
        spec = importlib.util.find_spec("torch")
        if spec is None or not spec.submodule_search_locations:
            return None
        version_file = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    try:
        tree = ast.parse(version_file.read_text())
    except (OSError, SyntaxError):
        return None
    values = {}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and isinstance(getattr(node, "value", None), ast.Constant):
            values[target.id] = node.value.value
    if "__version__" not in values:
        return None
    return str(values["__version__"]), values.get("cuda")


def parse_report(report: str) -> tuple[str | None, tuple[int, int] | None]:
    """(driver version, (CUDA major, minor)) from `nvidia-smi -q`; None for what it does not print."""
    cuda, driver = _CUDA.search(report), _DRIVER.search(report)
    return (driver.group(1) if driver else None,
            (int(cuda.group(1)), int(cuda.group(2))) if cuda else None)


def parse_cuda(text: str | None) -> tuple[int, int] | None:
    """(major, minor) of a version such as "12.8"; None for None."""
    if text is None:
        return None
    match = re.match(r"(\d+)\.(\d+)", str(text))
    if not match:
        raise ValueError(f"not a CUDA version: {text!r}")
    return int(match.group(1)), int(match.group(2))


def verdict(torch_version: str, torch_cuda: str | None, driver: str,
            driver_cuda: tuple[int, int]) -> tuple[bool, str]:
    """(runs, what to say) for torch `torch_version` built for CUDA `torch_cuda` on a driver `driver` that
    supports CUDA `driver_cuda`."""
    have = f"{driver_cuda[0]}.{driver_cuda[1]}"
    node = f"the driver {driver} supports CUDA {have}"
    wheel = f"Put torch's wheel of CUDA {driver_cuda[0]}.x in the wheelhouse ({WHEELHOUSE_DOC})"
    built = parse_cuda(torch_cuda)
    if built is None:
        return False, (f"torch {torch_version} in the venv is a CPU build (torch.version.cuda is None) "
                       f"and the layout's device is cuda; {node}. {wheel}, or train on device cpu")
    wants = f"{built[0]}.{built[1]}"
    if built[0] > driver_cuda[0]:
        return False, (f"torch {torch_version} is built for CUDA {wants}, but {node}: a CUDA runtime of "
                       "a newer major version does not run on it (NVIDIA's CUDA Compatibility guide; CUDA "
                       "would fail with \"CUDA driver version is insufficient for CUDA runtime version\"). "
                       f"{wheel}, or install a driver of CUDA {wants} or later")
    if built > driver_cuda:
        return True, (f"torch {torch_version} (CUDA {wants}) runs on the driver {driver} (CUDA {have}) "
                      "through CUDA's minor version compatibility, without PTX JIT compilation "
                      f"(NVIDIA's CUDA Compatibility guide); a driver of CUDA {wants} or later has none "
                      "of its limits")
    return True, f"torch {torch_version} (CUDA {wants}) suits the driver {driver} (CUDA {have})"


def check(report: str, build: tuple[str, str | None] | None) -> tuple[bool, str] | None:
    """The verdict for torch `build` on the driver of the `nvidia-smi -q` `report`; None when either is
    unknown (no torch, or a report without the versions)."""
    driver, driver_cuda = parse_report(report)
    if build is None or driver is None or driver_cuda is None:
        return None
    return verdict(build[0], build[1], driver, driver_cuda)


def read_report() -> str:
    """`nvidia-smi -q`'s output; raises OSError or CalledProcessError (with its output) when it fails."""
    return subprocess.run(NVIDIA_SMI_REPORT, capture_output=True, text=True, timeout=60, check=True).stdout
