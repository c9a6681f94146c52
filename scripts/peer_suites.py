"""Fetch the connection test suites of the projects whose connections ours extends, as they release them.

    python scripts/peer_suites.py            # into .cache/peer-suites/ (make peer-suites); silent when there

- ansible-core's `test/integration/targets/connection` (its `test_connection.yml` with unicode, spaces,
  brackets and quotes in paths, `test_reset_connection*.yml`, the no-connection-vars-in-output check),
  from the ansible-core sdist of the version installed in the venv;
- community.proxmox's `connection`, `connection_posix` and `connection_proxmox_pct_remote` targets, from
  the sdist of the `ansible` package installed in the venv (it bundles community.proxmox with its tests).

Both come from the package index through pip, at the exact versions the venv runs, and are unpacked
unchanged; the tests (tests/pvesim/test_peer_suites.py) add only an inventory. Nothing of them is kept
in this repository.
"""

import argparse
import importlib.metadata
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DIR = REPO / ".cache" / "peer-suites"

# distribution -> the members of its sdist to unpack (prefixes below the sdist's top directory)
SUITES = {
    "ansible-core": ["test/integration/targets/connection/"],
    "ansible": [f"ansible_collections/community/proxmox/tests/integration/targets/{target}/"
                for target in ("connection", "connection_posix", "connection_proxmox_pct_remote")],
}


def suite_dir(root, dist):
    """Where the suites of `dist`, at the venv's version, are unpacked."""
    return Path(root) / f"{dist}-{importlib.metadata.version(dist)}"


def unpack(sdist, prefixes, dest):
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/", 1)[0]
        members = [m for m in tar.getmembers()
                   if any(m.name.startswith(f"{top}/{p}") for p in prefixes) and (m.isfile() or m.isdir())]
        if not any(m.isfile() for m in members):
            sys.exit(f"peer-suites: {sdist.name} has none of {prefixes}")
        for m in members:
            m.name = m.name[len(top) + 1:]
        tar.extractall(dest, members=members, filter="data")


def fetch(root):
    for dist, prefixes in SUITES.items():
        dest = suite_dir(root, dist)
        if (dest / ".complete").exists():
            continue
        version = importlib.metadata.version(dist)
        print(f"peer-suites: {dist}=={version} (sdist from the package index) -> {dest}", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                            "--no-binary", ":all:", "-d", tmp, f"{dist}=={version}"], check=True)
            (sdist,) = Path(tmp).glob("*.tar.gz")
            unpack(sdist, prefixes, dest)
        (dest / ".complete").write_text(f"{dist}=={version}\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR,
                        help=f"where to unpack (default {DEFAULT_DIR})")
    fetch(parser.parse_args(argv).dir)


if __name__ == "__main__":
    main()
