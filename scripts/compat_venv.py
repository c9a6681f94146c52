"""Build the virtual environment that checks exports against the transformers the public DFlash code pins.

    python scripts/compat_venv.py            # into .cache/compat-venv/ (make compat-venv); silent when there

The public DFlash inference code pins transformers==4.57.1, which reads a config differently from the
transformers this project runs (the RoPE base, for one). tests/dflash/test_export_compat.py reloads an
export under that version in this venv, and skips (naming `make compat-venv`) while it does not exist.
torch stays on ==2.13.0: its CPU wheel is on disk; a looser pin pulls a multi-GB CUDA build.
"""

import argparse
import subprocess
import sys
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DIR = REPO / ".cache" / "compat-venv"
REQUIREMENTS = ("torch==2.13.0", "transformers==4.57.1", "safetensors")
# Written last: a venv without it is an interrupted build and is built again.
COMPLETE = ".complete"


def build(root: Path) -> None:
    stamp = root / COMPLETE
    wanted = "\n".join(REQUIREMENTS) + "\n"
    if stamp.is_file() and stamp.read_text() == wanted:
        return
    print(f"compat-venv: {' '.join(REQUIREMENTS)} from the package index -> {root}", flush=True)
    venv.create(root, with_pip=True, clear=True)
    python = root / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", *REQUIREMENTS], check=True)
    stamp.write_text(wanted)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR,
                        help=f"venv directory (default {DEFAULT_DIR})")
    build(parser.parse_args(argv).dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
