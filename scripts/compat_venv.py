"""Build the virtual environment that checks exports against the transformers the public DFlash code pins.

    python scripts/compat_venv.py            # into .cache/compat-venv/ (make compat-venv); silent when there

The public DFlash inference code pins transformers==4.57.1, which reads a config differently from the
transformers this project runs (the RoPE base, for one). tests/dflash/serve/test_export_compat.py reloads an
export under that version in this venv, and skips (naming `make compat-venv`) while it does not exist.
torch stays on ==2.13.0: its CPU wheel is on disk; a looser pin pulls a multi-GB CUDA build.
"""

import sys

import cached_venv

DEFAULT_DIR = cached_venv.REPO / ".cache" / "compat-venv"
REQUIREMENTS = ("torch==2.13.0", "transformers==4.57.1", "safetensors")

if __name__ == "__main__":
    sys.exit(cached_venv.main(None, __doc__, DEFAULT_DIR, REQUIREMENTS, label="compat-venv"))
