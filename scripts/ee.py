"""The execution environment of execution-environment.yml, for AWX, Automation Controller and
ansible-navigator (ansible-navigator.yml names the image).

    python scripts/ee.py [--out DIR]            # `make ee-context`: the build context in DIR/context
    python scripts/ee.py --build [--out DIR]    # `make ee`: and the image, with podman

The collection's artifact is built from ansible_collections/dflash/ops (`ansible-galaxy collection
build`, named from galaxy.yml's version) and copied to DIR/dflash-ops.tar.gz, the one name
execution-environment.yml knows: the version has one source, galaxy.yml. The image is tagged
dflash-ops-ee:<version> and dflash-ops-ee:latest. Run with the venv's python (make does).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
COLLECTION = REPO / "ansible_collections" / "dflash" / "ops"
DEFINITION = REPO / "execution-environment.yml"
BIN = Path(sys.executable).parent
IMAGE = "dflash-ops-ee"
ARTIFACT = "dflash-ops.tar.gz"  # what execution-environment.yml's additional_build_files names


def version() -> str:
    return yaml.safe_load((COLLECTION / "galaxy.yml").read_text())["version"]


def context(out: Path) -> Path:
    """The artifact built into `out` and the build context written to out/context; returns the context."""
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run([str(BIN / "ansible-galaxy"), "collection", "build", str(COLLECTION), "--output-path",
                    str(out), "--force"], check=True, stdin=subprocess.DEVNULL)
    shutil.copyfile(out / f"dflash-ops-{version()}.tar.gz", out / ARTIFACT)
    # ansible-builder reads additional_build_files relative to the definition's directory: a copy of it
    # beside the artifact's ee/ folder keeps `src: ee/dflash-ops.tar.gz` true for any `out`.
    if out.parent != REPO:
        shutil.copyfile(DEFINITION, out.parent / DEFINITION.name)
    ctx = out / "context"
    subprocess.run([str(BIN / "ansible-builder"), "create", "-f", DEFINITION.name, "-c", str(ctx),
                    "--output-filename", "Containerfile"],
                   check=True, cwd=out.parent, stdin=subprocess.DEVNULL)
    return ctx


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "ee",
                        help="where the artifact and the context go; its name must be ee (default ./ee)")
    parser.add_argument("--build", action="store_true", help="build the image with podman too")
    args = parser.parse_args(argv)
    if args.out.name != "ee":
        parser.error(f"--out must be a directory named ee (execution-environment.yml reads ee/{ARTIFACT})")
    if args.build and shutil.which("podman") is None:
        print("ee: podman is not installed (apt-get install podman); the context alone: make ee-context",
              file=sys.stderr)
        return 2
    ctx = context(args.out.resolve())
    print(f"ee: context in {ctx}")
    if args.build:
        tags = [f"{IMAGE}:{version()}", f"{IMAGE}:latest"]
        subprocess.run([str(BIN / "ansible-builder"), "build", "-f", DEFINITION.name, "-c", str(ctx),
                        "--container-runtime", "podman", *(arg for tag in tags for arg in ("-t", tag))],
                       check=True, cwd=args.out.resolve().parent, stdin=subprocess.DEVNULL)
        print(f"ee: built {', '.join(tags)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
