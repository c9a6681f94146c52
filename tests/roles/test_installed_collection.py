"""The collection as a user gets it: `ansible-galaxy collection build` makes the artifact,
`ansible-galaxy collection install --offline` puts it into an empty collections path, and its playbooks
run by name (`ansible-playbook dflash.ops.deploy`) from a directory that holds only an inventory and an
ansible.cfg naming that path: no checkout anywhere Ansible looks (not the working directory, not
ansible.cfg's collections_path, not Python's path).

community.proxmox, the collection's one dependency, is the one the pinned `ansible` package bundles on
Python's path (Ansible scans it for ansible_collections/): `--offline` resolves the dependency against it
(`'community.proxmox:1.4.0' is already installed`), as it would against one installed from Galaxy with the
root's requirements.yml. The trainer's source is not in the collection: a deploy is told where it is
(-e dflash_release_source_dir=<a dflash-ops checkout>/dflash_ops), and refuses clearly when it is not."""

import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
from types import SimpleNamespace

import pytest
import yaml

from pvesim.fleet import REPO, VENV_BIN, Fleet, ansible_env

COLLECTION = REPO / "ansible_collections" / "dflash" / "ops"
VERSION = yaml.safe_load((COLLECTION / "galaxy.yml").read_text())["version"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The artifact built, installed offline into root/collections, and root/site with an ansible.cfg
    that names that path alone. Returns its root, artifact, collections path, site and environment."""
    root = tmp_path_factory.mktemp("galaxy")
    collections, site = root / "collections", root / "site"
    site.mkdir()
    (site / "ansible.cfg").write_text(f"[defaults]\ncollections_path = {collections}\n")
    env = ansible_env(ANSIBLE_CONFIG=str(site / "ansible.cfg"))
    for name in ("PYTHONPATH", "ANSIBLE_COLLECTIONS_PATH", "ANSIBLE_COLLECTIONS_PATHS"):
        env.pop(name, None)  # the repo on Python's path would offer its own copy of the collection

    def galaxy(*args):
        res = subprocess.run([str(VENV_BIN / "ansible-galaxy"), "collection", *args], capture_output=True,
                             text=True, cwd=site, timeout=120, env=env, stdin=subprocess.DEVNULL)
        assert res.returncode == 0, res.stdout + res.stderr
        return res.stdout

    galaxy("build", str(COLLECTION), "--output-path", str(root))
    artifact = root / f"dflash-ops-{VERSION}.tar.gz"
    installing = galaxy("install", str(artifact), "--offline")
    return SimpleNamespace(root=root, artifact=artifact, collections=collections, site=site, env=env,
                           installing=installing, galaxy=galaxy)


def playbook(installed, *args, timeout=300):
    return subprocess.run([str(VENV_BIN / "ansible-playbook"), *args], env=installed.env, cwd=installed.site,
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def test_the_artifact_ships_the_playbooks_their_files_and_the_metadata(installed):
    with tarfile.open(installed.artifact) as tar:
        names = set(tar.getnames())
        manifest = json.load(tar.extractfile("MANIFEST.json"))["collection_info"]
    shipped = {p.relative_to(COLLECTION).as_posix() for p in (COLLECTION / "playbooks").rglob("*")
               if p.is_file()}
    assert shipped and shipped <= names, sorted(shipped - names)
    assert {"playbooks/deploy.yml", "playbooks/vars/roles.yml", "playbooks/tasks/prepare.yml",
            "playbooks/templates/status_table.j2", "meta/runtime.yml", "LICENSE",
            "changelogs/changelog.yaml", "CHANGELOG.rst"} <= names
    assert not [n for n in names if "/molecule/" in n or n.endswith(".pyc")]
    assert manifest["version"] == VERSION and manifest["license"] == ["GPL-3.0-or-later"]
    assert manifest["dependencies"] == yaml.safe_load((COLLECTION / "galaxy.yml").read_text())["dependencies"]
    # The dependency came from Python's path: nothing but dflash.ops went into the empty path.
    assert "'community.proxmox:1.4.0' is already installed" in installed.installing, installed.installing
    assert sorted(p.name for p in (installed.collections / "ansible_collections").iterdir()) == ["dflash"]


def test_module_defaults_reach_the_pct_modules_through_their_action_group(installed):
    """meta/runtime.yml's group, from the installed copy: pct_argv set once for group/dflash.ops.pct
    is the one pct_container_check runs (and names when it is missing)."""
    (installed.site / "group.yml").write_text(yaml.safe_dump([{
        "name": "Check a container with the group's pct.", "hosts": "localhost", "gather_facts": False,
        "module_defaults": {"group/dflash.ops.pct": {"pct_argv": ["/nonexistent/bin/pct"]}},
        "tasks": [{"name": "Check the container.", "dflash.ops.pct_container_check": {"vmid": 200}}]}]))
    res = playbook(installed, "-i", "localhost,", "-c", "local",
                   "-e", f"ansible_python_interpreter={sys.executable}", "group.yml")
    assert res.returncode != 0
    assert "/nonexistent/bin/pct is missing on node" in res.stdout, res.stdout + res.stderr


def ee_script():
    spec = importlib.util.spec_from_file_location("ee", REPO / "scripts" / "ee.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_execution_environment_builds_its_context_and_installs_the_collection_with_its_packages(
        installed, tmp_path):
    """`make ee-context` (scripts/ee.py) as ansible-builder reads it: the artifact built from galaxy.yml's
    version under the one name execution-environment.yml knows, the build context written (schema
    checked) with it; the context's own galaxy stage (its requirements.yml, in its /build) installs the
    collection, and the builder stage's introspect.py finds the collection's Python packages (the ranges
    of pyproject.toml's [controller] extra) and its system packages (the OpenSSH client the nodes'
    ansible.builtin.ssh runs), which the Containerfile installs. Here the galaxy stage runs --offline."""
    context = ee_script().context(tmp_path / "ee")
    build = context / "_build"
    shipped = build / "collections" / "dflash-ops.tar.gz"
    with tarfile.open(shipped) as tar:
        manifest = json.load(tar.extractfile("MANIFEST.json"))
    assert manifest["collection_info"]["version"] == VERSION
    collections = tmp_path / "usr-share-ansible"
    (tmp_path / "ansible.cfg").write_text(f"[defaults]\ncollections_path = {collections}\n")
    env = {**installed.env, "ANSIBLE_CONFIG": str(tmp_path / "ansible.cfg")}
    stage = subprocess.run([str(VENV_BIN / "ansible-galaxy"), "collection", "install", "--offline", "-r",
                            "requirements.yml", "--collections-path", str(collections)], cwd=build,
                           env=env, capture_output=True, text=True, timeout=120)
    assert stage.returncode == 0, stage.stdout + stage.stderr
    assert (collections / "ansible_collections" / "dflash" / "ops" / "MANIFEST.json").is_file()
    found = subprocess.run([sys.executable, str(build / "scripts" / "introspect.py"), "introspect",
                            str(collections)], capture_output=True, text=True, timeout=60, check=True)
    introspected = yaml.safe_load(found.stdout)
    python = {line.split("#")[0].strip() for line in introspected["python"]
              if line.endswith("# from collection dflash.ops")}
    controller = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"][
        "controller"]
    assert python == {r for r in controller if not r.startswith("ansible-core")}, found.stdout
    assert not any("==" in r for r in python), python  # ranges: a merged environment can resolve them
    system = {line.split("#")[0].strip() for line in introspected["system"]
              if line.endswith("# from collection dflash.ops")}
    assert "openssh-clients [platform:rpm]" in system, found.stdout
    containerfile = (context / "Containerfile").read_text()
    assert "introspect" in containerfile and "install-from-bindep" in containerfile, containerfile


def test_the_execution_environment_image_builds_with_podman(tmp_path):
    """`make ee`: the image itself, where podman is (its base image and Galaxy come from the network)."""
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed: no image is built here (the context is checked above)")
    assert ee_script().main(["--build", "--out", str(tmp_path / "ee")]) == 0


def test_ansible_navigator_runs_the_image_make_ee_tags():
    navigator = yaml.safe_load((REPO / "ansible-navigator.yml").read_text())["ansible-navigator"]
    ee = navigator["execution-environment"]
    assert ee["enabled"] is True and ee["image"] == f"{ee_script().IMAGE}:latest", ee
    assert ee["pull"]["policy"] == "never", ee  # a local image: a pull would fail or take another one


@pytest.mark.sim
@pytest.mark.slow
def test_a_deploy_runs_from_the_installed_collection_with_no_checkout(installed, tmp_path_factory):
    """Without the trainer's source a deploy stops before any release exists, naming the variable; with
    it, dflash.ops.deploy ships the release and starts the run, every task from the installed copy."""
    fleet = Fleet(tmp_path_factory.mktemp("installed-fleet"), nodes=1, containers=(200,))
    try:
        # The sim's inventory, its group_vars copied (not linked into the checkout).
        shutil.copytree(fleet.base / "inventory", installed.site / "inventory", symlinks=False)
        installed.env["DFLASH_SIM_ASSETS"] = str(fleet.assets)
        inventory = str(installed.site / "inventory" / "hosts.yml")

        res = playbook(installed, "-i", inventory, "dflash.ops.deploy")
        assert res.returncode != 0
        assert "set dflash_release_source_dir to the dflash_ops/ directory" in res.stdout, (
            res.stdout + res.stderr)
        assert fleet.live_release(200) == "" and fleet.run_info(200) is None

        res = playbook(installed, "-vv", "-i", inventory, "dflash.ops.deploy",
                       "-e", f"dflash_release_source_dir={fleet.src / 'dflash_ops'}")
        assert res.returncode == 0, res.stdout[-6000:] + res.stderr
        task_paths = set(re.findall(r"^task path: (\S+?):\d+$", res.stdout, re.MULTILINE))
        assert task_paths, res.stdout[-3000:]
        outside = {p for p in task_paths if not p.startswith(str(installed.collections) + "/")}
        assert not outside, f"tasks not from the installed collection: {sorted(outside)}"
        release_dir = fleet.live_release(200)
        run = fleet.run_info(200)
        assert run and run["argv"] == [f"{release_dir}/run.sh"] and fleet.alive(200, run["pid"]), run
        # The release is the source it was told of: its package's first file is the snapshot's.
        shipped = fleet.read(200, f"{release_dir}/dflash_ops/__init__.py")
        assert shipped == (fleet.src / "dflash_ops" / "__init__.py").read_text()
    finally:
        fleet.down()
