"""Fetch the connection test suites of the projects whose connections ours extends, as they release them.

    python scripts/peer_suites.py            # into .cache/peer-suites/ (make peer-suites); silent when there
    DFLASH_ANSIBLE_BIN=.cache/newest-venv/bin python scripts/peer_suites.py   # that venv's versions

- ansible-core's `test/integration/targets/connection` (its `test_connection.yml` with unicode, spaces,
  brackets and quotes in paths, `test_reset_connection*.yml`, the no-connection-vars-in-output check),
  from the ansible-core sdist of the version installed in the venv;
- community.proxmox's `connection`, `connection_posix` and `connection_proxmox_pct_remote` targets, and its
  unit suite of the connection (docs/patches/ is tested with it), from the sdist of the `ansible` package
  installed in the venv: it bundles community.proxmox whole, with its tests.

Both come from the package index through pip, at the exact versions the Ansible of the tests runs (this
venv's, or that of the venv whose bin/ DFLASH_ANSIBLE_BIN names: pvesim.fleet.ANSIBLE_BIN), and are unpacked
unchanged; the tests (tests/pvesim/test_peer_suites.py) add only an inventory. Nothing of them is kept
in this repository.
"""

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from pvesim.fleet import ANSIBLE_BIN  # noqa: E402

DEFAULT_DIR = REPO / ".cache" / "peer-suites"

# distribution -> the members of its sdist to unpack (prefixes below the sdist's top directory)
SUITES = {
    "ansible-core": ["test/integration/targets/connection/"],
    "ansible": ["ansible_collections/community/proxmox/"],
}
COMMUNITY_PROXMOX = "ansible_collections/community/proxmox"  # in the `ansible` suite's directory


def versions(bin_dir=ANSIBLE_BIN):
    """{distribution: version} of the suites' distributions installed beside the Ansible in `bin_dir`."""
    code = ("import importlib.metadata as m, json, sys; "
            f"json.dump({{d: m.version(d) for d in {list(SUITES)!r}}}, sys.stdout)")
    res = subprocess.run([str(Path(bin_dir) / "python"), "-c", code], capture_output=True, text=True,
                         check=True)
    return json.loads(res.stdout)


def suite_dir(root, dist, bin_dir=ANSIBLE_BIN):
    """Where the suites of `dist`, at the version the Ansible in `bin_dir` runs, are unpacked."""
    return Path(root) / f"{dist}-{versions(bin_dir)[dist]}"


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


def fetch(root, bin_dir=ANSIBLE_BIN):
    for dist, version in versions(bin_dir).items():
        dest = Path(root) / f"{dist}-{version}"
        stamp = f"{dist}=={version} {' '.join(SUITES[dist])}\n"  # another selection is unpacked anew
        if (dest / ".complete").exists() and (dest / ".complete").read_text() == stamp:
            continue
        shutil.rmtree(dest, ignore_errors=True)
        print(f"peer-suites: {dist}=={version} (sdist from the package index) -> {dest}", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            # That venv's pip: an `ansible` that needs a newer Python than this one is still offered to it.
            subprocess.run([str(Path(bin_dir) / "python"), "-m", "pip", "download", "-q", "--no-deps",
                            "--no-binary", ":all:", "-d", tmp, f"{dist}=={version}"], check=True)
            (sdist,) = Path(tmp).glob("*.tar.gz")
            unpack(sdist, SUITES[dist], dest)
        (dest / ".complete").write_text(stamp)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR,
                        help=f"where to unpack (default {DEFAULT_DIR})")
    fetch(parser.parse_args(argv).dir)


if __name__ == "__main__":
    main()
