"""dflash_release_tree run the way Ansible runs a module (a JSON file of arguments, JSON on stdout), on
local directories, with real release archives packed by its action plugin's release_pack and validated by
the trainer's own `python -m dflash_ops.config validate` (its documentation: test_module_docs.py)."""

import base64
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import yaml

from pvesim.fleet import REPO

COLLECTION = REPO / "ansible_collections" / "dflash" / "ops"
TREE = COLLECTION / "plugins" / "modules" / "dflash_release_tree.py"


def load(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pack_release = load(COLLECTION / "plugins" / "plugin_utils" / "release_pack.py")
dflash_release_tree = load(TREE)

GOOD = {"model": {"target_path": "/srv/models/target"}, "data": {"path": "/srv/data/train.jsonl"},
        "run": {"output_dir": "/var/lib/dflash/runs/main"}, "pipeline": {"device": "cpu"}}
# What the role passes (dflash_release_check_paths false: the test machine has no target model).
VALIDATE = {"validate_argv": [sys.executable, "-m", "dflash_ops.config", "validate", "%s/config.yaml",
                              "--no-target-check"],
            "validate_environment": {"PYTHONPATH": "%s"}}
RETURNED = {"current", "release", "live", "validated", "validation", "staging", "removed"}


class Tree:
    """A release root in a temporary directory and the module called on it."""

    def __init__(self, tmp_path):
        self.tmp = tmp_path
        self.root = tmp_path / "opt"
        self.build = tmp_path / "build"
        self.calls = 0

    def pack(self, config, marker=""):
        """(release dir, base64 archive) of the trainer's code with `config` rendered."""
        files = {"config.yaml": yaml.safe_dump(config) + marker, "run.sh": "#!/bin/sh\nexit 0\n"}
        built = pack_release.pack(str(REPO / "dflash_ops"), str(self.build), "test", files)
        return str(self.root / "releases" / built["id"]), open(built["archive_b64"]).read()

    def call(self, check=False, **args):
        args = {"root": str(self.root), **args, "_ansible_check_mode": check}
        args_file = self.tmp / f"args-{self.calls}.json"
        self.calls += 1
        args_file.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": args}))
        # cwd away from the repository: `python -m dflash_ops.config` must import the release's own code.
        # The module's own imports (the collection's module_utils) come from a path that holds the
        # collection alone, as Ansible's payload would give them.
        collection_path = self.tmp / "collection-path"
        if not collection_path.exists():
            collection_path.mkdir()
            (collection_path / "ansible_collections").symlink_to(REPO / "ansible_collections")
        proc = subprocess.run([sys.executable, str(TREE), str(args_file)], capture_output=True, text=True,
                              timeout=120, cwd=self.tmp,
                              env={**os.environ, "PYTHONPATH": str(collection_path)})
        try:
            return json.loads(proc.stdout)
        except ValueError:
            pytest.fail(f"the module printed no JSON (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")

    def link(self, name):
        path = self.root / name
        return os.readlink(path) if path.is_symlink() else None

    def releases(self):
        return sorted(os.listdir(self.root / "releases"))


@pytest.fixture
def tree(tmp_path):
    return Tree(tmp_path)


def test_a_new_release_is_unpacked_validated_and_made_live_in_one_call(tree):
    first, content = tree.pack(GOOD)
    res = tree.call(release=first, content=content, **VALIDATE)
    assert not res.get("failed"), res
    assert RETURNED <= set(res)
    assert res["changed"] and res["live"] and res["validated"] is True
    assert tree.link("current") == first and tree.link("previous") is None
    # The trainer validated the staging copy, with that copy's code, before it moved into place.
    staging = dflash_release_tree.staging_dir(first)
    assert res["staging"] == res["validation"]["dir"] == staging
    assert res["validation"]["cmd"][4] == f"{staging}/config.yaml"
    assert res["validation"]["rc"] == 0
    assert res["validation"]["stdout"].strip() == f"{staging}/config.yaml: ok"
    assert tree.releases() == [os.path.basename(first)]
    assert oct(os.stat(f"{first}/run.sh").st_mode & 0o777) == oct(0o755)

    second, content = tree.pack(GOOD, marker="# second\n")
    os.makedirs(tree.root / "releases" / ".staging-leftover")
    res = tree.call(release=second, content=content, keep=1, **VALIDATE)
    assert res["changed"] and res["validated"] is True and res["current"] == first
    assert tree.link("current") == second and tree.link("previous") == first
    # keep=1 keeps the live release and the previous one; staging leftovers go.
    assert res["removed"] == [str(tree.root / "releases" / ".staging-leftover")]
    assert tree.releases() == sorted(os.path.basename(r) for r in (first, second))


def test_a_release_that_does_not_validate_goes_live_nowhere_and_says_why(tree):
    first, content = tree.pack(GOOD)
    tree.call(release=first, content=content, **VALIDATE)
    second, content = tree.pack(GOOD, marker="# second\n")
    tree.call(release=second, content=content, **VALIDATE)

    bad, content = tree.pack({**GOOD, "run": {**GOOD["run"], "save_evry": 10}})
    res = tree.call(release=bad, content=content, keep=1, **VALIDATE)
    # Not a failed task: the role's assert turns the trainer's words into the message.
    assert not res.get("failed") and "rc" not in res, res
    assert res["validated"] is False and res["live"] is False
    assert res["validation"]["rc"] == 2
    assert "run: unknown key(s) save_evry" in res["validation"]["stderr"]
    assert res["validation"]["dir"] == dflash_release_tree.staging_dir(bad)
    # Nothing moved, switched or pruned; the staging directory is left for inspection.
    assert tree.link("current") == second and tree.link("previous") == first
    assert res["removed"] == []
    assert not os.path.exists(bad)
    assert os.path.isfile(os.path.join(res["staging"], "config.yaml"))

    # The next good release goes live and takes the leftover with it.
    third, content = tree.pack(GOOD, marker="# third\n")
    res = tree.call(release=third, content=content, keep=3, **VALIDATE)
    assert res["validated"] is True and tree.link("current") == third
    assert res["removed"] == [dflash_release_tree.staging_dir(bad)]


def test_an_existing_release_is_validated_and_switched_to_without_unpacking(tree):
    first, content = tree.pack(GOOD)
    tree.call(release=first, content=content, **VALIDATE)
    second, content = tree.pack(GOOD, marker="# second\n")
    tree.call(release=second, content=content, **VALIDATE)

    res = tree.call(release=first, **VALIDATE)
    assert res["changed"] and res["validated"] is True and res["staging"] is None
    assert res["validation"]["dir"] == first
    assert tree.link("current") == first and tree.link("previous") == second

    # An existing release that no longer validates (its config was changed in place) is not switched to.
    with open(f"{second}/config.yaml", "a") as fh:
        fh.write("optim: {lr: fast}\n")
    res = tree.call(release=second, **VALIDATE)
    assert res["validated"] is False and not res["changed"]
    assert "optim.lr" in res["validation"]["stderr"]
    assert tree.link("current") == first


def test_the_live_release_is_left_as_it_is_and_not_validated_again(tree):
    first, content = tree.pack(GOOD)
    tree.call(release=first, content=content, **VALIDATE)
    before = sorted(os.walk(first))
    # A validation that would fail shows that none runs for the live release.
    failing = [sys.executable, "-c", "raise SystemExit(3)"]
    res = tree.call(release=first, content=content, validate_argv=failing)
    assert not res["changed"] and res["live"] and res["validated"] is None and res["validation"] is None
    assert sorted(os.walk(first)) == before and tree.link("previous") is None

    # ... but it is still checked for files other users could change.
    os.chmod(f"{first}/config.yaml", 0o666)
    res = tree.call(release=first, content=content, **VALIDATE)
    assert res["failed"] and "writable by other users" in res["msg"]


def test_previous_goes_back_validated_and_fails_without_a_previous_release(tree):
    first, content = tree.pack(GOOD)
    tree.call(release=first, content=content, **VALIDATE)
    res = tree.call(state="previous", **VALIDATE)
    assert res["failed"] and "no previous release to roll back to" in res["msg"]
    assert "previous does not exist" in res["msg"] and tree.link("current") == first

    second, content = tree.pack(GOOD, marker="# second\n")
    tree.call(release=second, content=content, **VALIDATE)
    res = tree.call(state="previous", **VALIDATE)
    assert res["changed"] and res["release"] == first and res["validated"] is True
    assert tree.link("current") == first and tree.link("previous") == second
    res = tree.call(state="previous", **VALIDATE)
    assert res["release"] == second and tree.link("current") == second


def test_check_mode_writes_nothing_and_runs_no_validation(tree):
    first, content = tree.pack(GOOD)
    tree.call(release=first, content=content, **VALIDATE)
    second, content = tree.pack(GOOD, marker="# second\n")
    res = tree.call(check=True, release=second, content=content, **VALIDATE)
    assert res["changed"] and res["validated"] is None and res["validation"] is None
    assert tree.releases() == [os.path.basename(first)]
    assert tree.link("current") == first and tree.link("previous") is None


def test_a_validation_that_cannot_start_fails_validation_with_the_reason(tree):
    first, content = tree.pack(GOOD)
    res = tree.call(release=first, content=content, validate_argv=[str(tree.tmp / "no-python"), "%s"])
    assert res["validated"] is False and res["validation"]["rc"] == 2
    assert "No such file or directory" in res["validation"]["msg"]
    assert not (tree.root / "current").exists()


def test_the_directory_replaces_every_placeholder(tree):
    cmd, env = dflash_release_tree.validation_command(
        ["py", "-m", "x", "%s/config.yaml", "--flag"], {"PYTHONPATH": "%s", "N": 1}, "/r/.staging-a")
    assert cmd == ["py", "-m", "x", "/r/.staging-a/config.yaml", "--flag"]
    assert env == {"PYTHONPATH": "/r/.staging-a", "N": "1"}
    # In the container: the validation imports the staged release's code, not another copy.
    first, content = tree.pack(GOOD)
    show = "import dflash_ops, os; print(dflash_ops.__file__, os.environ['WHERE'])"
    res = tree.call(release=first, content=content, validate_argv=[sys.executable, "-c", show],
                    validate_environment={"PYTHONPATH": "%s", "WHERE": "at %s"})
    staging = dflash_release_tree.staging_dir(first)
    assert res["validation"]["stdout"].split() == [f"{staging}/dflash_ops/__init__.py", "at", staging]


def test_containers_that_render_the_same_files_share_one_release_packed_once(tmp_path):
    code = tmp_path / "pkg"
    code.mkdir()
    (code / "__init__.py").write_text("")
    build = tmp_path / "build"
    same, other = {"config.yaml": "a: 1\n", "run.sh": ""}, {"config.yaml": "a: 2\n", "run.sh": ""}
    # Each container's task packs its own; the first packer of a release writes it, the others reuse it.
    packed = {host: pack_release.pack(str(code), str(build), "rev", files)
              for host, files in (("ct200", same), ("ct201", dict(same)), ("ct202", other))}
    assert packed["ct200"] == packed["ct201"] and packed["ct202"]["id"] != packed["ct200"]["id"]
    assert sorted(os.listdir(build)) == sorted(f"{packed[h]['id']}.tar.gz{ext}" for h in ("ct200", "ct202")
                                               for ext in ("", ".b64"))
    with open(packed["ct202"]["archive_b64"]) as fh:
        assert base64.b64decode(fh.read()) == open(packed["ct202"]["archive"], "rb").read()


@pytest.mark.parametrize("where", ["releases", "release", "staging", "inside"])
def test_a_symlink_in_the_release_tree_is_refused_and_nothing_is_switched(tree, where):
    """A releases/ directory, a release, its staging directory or a file in a release replaced by a
    symbolic link (elsewhere, to a directory root owns): nothing is unpacked or switched through it."""
    first, content = tree.pack(GOOD)
    assert not tree.call(release=first, content=content, **VALIDATE).get("failed")
    elsewhere = tree.tmp / "etc"
    elsewhere.mkdir()
    second, content = tree.pack(GOOD, marker="# second\n")
    if where == "releases":
        releases = tree.root / "releases"
        releases.rename(tree.tmp / "moved")
        (elsewhere / os.path.basename(first)).symlink_to(tree.tmp / "moved" / os.path.basename(first))
        releases.symlink_to(elsewhere)
    elif where == "release":
        os.symlink(elsewhere, second)
    elif where == "staging":
        os.symlink(elsewhere, dflash_release_tree.staging_dir(second))
    else:
        os.symlink("/etc/passwd", f"{first}/dflash_ops/passwd.py")
        second = first
    res = tree.call(release=second, content=content, **VALIDATE)
    assert res.get("failed"), res
    assert "symbolic link" in res["msg"], res
    assert tree.link("current") == first
    assert sorted(os.listdir(elsewhere)) == ([os.path.basename(first)] if where == "releases" else [])


def test_a_release_that_does_not_fit_fails_before_anything_is_unpacked(tree, small_filesystem):
    """releases/ on a full disk: the unpack fails saying what it needs and what is free, nothing is left
    half-unpacked, nothing is switched; with room again the same call goes live."""
    first, content = tree.pack(GOOD)
    needed, _ = dflash_release_tree.unpacked_size(base64.b64decode(content))
    small_filesystem(tree.root / "releases", size=needed // 2)
    res = tree.call(release=first, content=content, **VALIDATE)
    assert res.get("failed"), res
    assert "No space left on device" in res["msg"] and "MiB free" in res["msg"], res
    assert "nothing was unpacked or switched" in res["msg"], res
    assert tree.link("current") is None and tree.releases() == []
    subprocess.run(["mount", "-o", f"remount,size={needed * 4}", str(tree.root / "releases")], check=True)
    res = tree.call(release=first, content=content, **VALIDATE)
    assert not res.get("failed") and tree.link("current") == first, res
