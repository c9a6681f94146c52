"""torch's CUDA build against the driver's CUDA version (NVIDIA's CUDA Compatibility guide), read without
importing torch; `validate`'s refusal of a cuda layout on a CPU build is in test_memory_fit.py."""

from __future__ import annotations

import pytest
import torch

from dflash_ops.core import cuda_build


@pytest.mark.parametrize(("built", "driver_cuda", "runs", "words"), [
    (None, (12, 4), False, "is a CPU build (torch.version.cuda is None)"),
    ("13.0", (12, 8), False, "a CUDA runtime of a newer major version does not run on it"),
    ("12.8", (12, 4), True, "through CUDA's minor version compatibility, without PTX JIT compilation"),
    ("12.4", (12, 8), True, "suits the driver 570.1 (CUDA 12.8)"),
    ("11.8", (12, 4), True, "suits the driver 570.1 (CUDA 12.4)"),
])
def test_the_verdict_follows_nvidia_s_compatibility_rules(built, driver_cuda, runs, words):
    ok, message = cuda_build.verdict("2.13.0", built, "570.1", driver_cuda)
    assert ok is runs and words in message, message
    if not ok:
        assert 'docs/OPERATIONS.md, "The wheelhouse"' in message


def test_the_installed_torch_is_read_as_torch_itself_says():
    assert cuda_build.torch_build() == (torch.__version__, torch.version.cuda)


def test_a_cuda_wheel_s_version_file(tmp_path):
    """The file torch's build generates (tools/generate_torch_version.py), as a cu128 wheel has it."""
    version = tmp_path / "version.py"
    version.write_text("from typing import Optional\n\n__version__ = '2.13.0+cu128'\ndebug = False\n"
                       "cuda: Optional[str] = '12.8'\nhip: Optional[str] = None\n")
    assert cuda_build.torch_build(version) == ("2.13.0+cu128", "12.8")
    assert cuda_build.torch_build(tmp_path / "missing.py") is None


def test_the_driver_report_and_what_it_lacks():
    report = f"\n{'Driver Version':<38}: 550.127.05\n{'CUDA Version':<38}: 12.4\n"
    assert cuda_build.parse_report(report) == ("550.127.05", (12, 4))
    assert cuda_build.check(report, ("2.13.0+cu128", "12.8"))[0] is True
    assert cuda_build.check("0, 143771\n", ("2.13.0+cu128", "12.8")) is None
    assert cuda_build.check(report, None) is None
    with pytest.raises(ValueError, match="not a CUDA version"):
        cuda_build.parse_cuda("twelve")
