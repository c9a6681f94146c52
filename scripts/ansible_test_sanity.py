"""`ansible-test sanity` on the dflash.ops collection, with what it needs from outside the package index.

Usage: python scripts/ansible_test_sanity.py [ansible-test sanity options, e.g. --test validate-modules]
Run with the venv's python (the one whose bin/ holds ansible-test); `make lint` does.

1. The pip bootstrap script. ansible-test creates each sanity test's virtualenv without pip, then runs
a `get-pip` script that it downloads from ci-files.testing.ansible.com into
~/.ansible/test/cache/get_pip_<version>.py (ansible_test/_util/target/setup/requirements.py,
`bootstrap`). The script written there instead does the same from the package index alone:
`ensurepip` puts the bundled pip into the virtualenv, then pip installs what ansible-test asked for
(`pip==<version>`).

2. The collection's dependencies (galaxy.yml: community.proxmox, which pct_pipelined extends).
ansible-test looks for them in the collection's own root (the repo's ansible_collections/); the pinned
`ansible` package holds them on Python's path. Each is linked into the root for the run only, so that
ansible-playbook, ansible-lint and ruff see the repo's one collection otherwise.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import yaml
from ansible_test._internal.python_requirements import get_venv_packages

COLLECTION_ROOT = Path(__file__).resolve().parent.parent / "ansible_collections"
COLLECTION = COLLECTION_ROOT / "dflash" / "ops"
PYTHON_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"

# ansible-test runs this as `python quiet_pip.py <pip install args> --no-setuptools --no-wheel`, with the
# script loaded as __main__; the two get-pip options have no pip install equivalent and are dropped.
BOOTSTRAP = '''"""ansible-test's pip bootstrap: ensurepip, then pip install the given packages."""
import subprocess
import sys

GET_PIP_ONLY = {"--no-setuptools", "--no-wheel"}

subprocess.run([sys.executable, "-m", "ensurepip", "--default-pip"], check=True, stdout=subprocess.DEVNULL)
args = [arg for arg in sys.argv[1:] if arg not in GET_PIP_ONLY]
subprocess.run([sys.executable, "-m", "pip", "install", *args], check=True)
'''


def bootstrap_path() -> Path:
    """Where ansible-test reads the bootstrap script of the pip it pins for this Python."""
    pip_version = get_venv_packages(SimpleNamespace(version=PYTHON_VERSION))["pip"]
    return Path.home() / ".ansible/test/cache" / f"get_pip_{pip_version.replace('.', '_')}.py"


def write_bootstrap() -> None:
    path = bootstrap_path()
    if path.exists() and path.read_text() == BOOTSTRAP:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(BOOTSTRAP)
    print(f"ansible-test pip bootstrap: {path}")


def link_dependencies() -> list[Path]:
    """Link each dependency into the collection root; a link left by an interrupted run is replaced."""
    links = []
    for fqcn in yaml.safe_load((COLLECTION / "galaxy.yml").read_text()).get("dependencies") or {}:
        link = COLLECTION_ROOT.joinpath(*fqcn.split("."))
        if link.is_symlink():
            link.unlink()
        elif link.exists():
            continue
        spec = importlib.util.find_spec(f"ansible_collections.{fqcn}")
        if spec is None:
            sys.exit(f"collection {fqcn} (a dependency in galaxy.yml) is not on this Python's path")
        link.parent.mkdir(exist_ok=True)
        link.symlink_to(next(iter(spec.submodule_search_locations)), target_is_directory=True)
        links.append(link)
    return links


def unlink(links: list[Path]) -> None:
    for link in links:
        link.unlink()
        if not any(link.parent.iterdir()):
            link.parent.rmdir()


def main() -> int:
    write_bootstrap()
    bin_dir = Path(sys.executable).parent
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    argv = [str(bin_dir / "ansible-test"), "sanity", "--python", PYTHON_VERSION, "--requirements",
            *sys.argv[1:]]
    links = link_dependencies()
    try:
        return subprocess.run(argv, cwd=COLLECTION, env=env, check=False).returncode
    finally:
        unlink(links)


if __name__ == "__main__":
    sys.exit(main())
