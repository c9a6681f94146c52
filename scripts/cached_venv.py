"""A virtual environment under .cache/ that a make target builds once from the package index.

`build(root, requirements, remove=..., python=...)` installs `requirements` into a fresh venv at `root` (of
`python`, an interpreter path, or of the one running this), then
uninstalls `remove` (packages a requirement drags in that break the ones wanted), and writes a stamp
naming both last: a venv whose stamp says the same is left alone (silent), and one without it (an
interrupted build) or with another is built again. `is_built(root)` is what a test checks to skip.
"""

import argparse
import subprocess
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Written last: a venv without it is an interrupted build and is built again.
COMPLETE = ".complete"


def _stamp_text(requirements, remove) -> str:
    lines = list(requirements) + [f"-{name}" for name in remove]
    return "\n".join(lines) + "\n"


def is_built(root: Path, requirements=None, remove=()) -> bool:
    stamp = Path(root) / COMPLETE
    if not stamp.is_file():
        return False
    return requirements is None or stamp.read_text() == _stamp_text(requirements, remove)


def build(root: Path, requirements, remove=(), label: str = "venv", python=None) -> None:
    if is_built(root, requirements, remove):
        return
    print(f"{label}: {' '.join(requirements)} from the package index -> {root}", flush=True)
    if python is None:
        venv.create(root, with_pip=True, clear=True)
    else:
        subprocess.run([str(python), "-m", "venv", "--clear", str(root)], check=True)
    python = str(Path(root) / "bin" / "python")
    subprocess.run([python, "-m", "pip", "install", "-q", *requirements], check=True)
    if remove:
        subprocess.run([python, "-m", "pip", "uninstall", "-q", "-y", *remove], check=True)
    (Path(root) / COMPLETE).write_text(_stamp_text(requirements, remove))


def main(argv, doc: str, default_dir: Path, requirements, remove=(), label: str = "venv") -> int:
    """The command line of a script that builds one such venv (`--dir` overrides where)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=default_dir,
                        help=f"venv directory (default {default_dir})")
    build(parser.parse_args(argv).dir, requirements, remove, label)
    return 0
