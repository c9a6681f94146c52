"""A controller installs without the trainer: `pip install '.[controller]'` has what the playbooks use on
the controller and nothing of torch's; the trainer's packages are their own extra, pinned as the
containers' venvs are; `.[dev]` (make setup) still gets both. And the controller's side of the product
(the playbooks' plugins, the connection, `python -m dflash_ops.plots`) runs with the trainer's packages
absent: a Python whose imports of them fail stands for a controller venv."""

import json
import re
import subprocess
import tomllib

import yaml
from packaging.requirements import Requirement

from pvesim.fleet import REPO, VENV_BIN, ansible_env

PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
EXTRAS = PROJECT["optional-dependencies"]
# What a controller never needs (the trainer's packages, and what only the tests use).
TRAINER_ONLY = {"torch", "transformers", "safetensors", "tokenizers", "tensorboard"}
# The containers' venv pins (the dflash_env role's dflash_env_requirements of the example inventory).
CONTAINER_GROUP_VARS = REPO / "inventory" / "production.example" / "group_vars" / "training_containers.yml"


def name(requirement):
    """A requirement's distribution name, normalised (PEP 503)."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement).group(0)).lower()


def names(requirements):
    return {name(r) for r in requirements}


def test_the_controller_extra_has_what_the_playbooks_use_and_nothing_of_the_trainer():
    controller = names(EXTRAS["controller"])
    assert not controller & TRAINER_ONLY, controller
    assert not names(PROJECT["dependencies"]) & TRAINER_ONLY, PROJECT["dependencies"]
    # ansible-playbook; the containers' connection (community.proxmox's proxmox_pct_remote needs paramiko);
    # fetch_metrics.yml's plots (python -m dflash_ops.plots on the controller).
    assert {"ansible-core", "paramiko", "matplotlib"} <= controller, controller
    fetch_metrics = (REPO / "ansible_collections/dflash/ops/playbooks/fetch_metrics.yml").read_text()
    assert "'-m', 'dflash_ops.plots'" in fetch_metrics


def test_pip_resolves_the_controller_extra_without_the_trainer():
    """What `pip install '.[controller]'` would install, resolved offline against this venv (which holds
    everything `.[dev]` pulls): ansible-core, paramiko and matplotlib with their dependencies, nothing of
    the trainer's."""
    res = subprocess.run([str(VENV_BIN / "python"), "-m", "pip", "install", "--dry-run", "--no-index",
                          "--no-build-isolation", f"{REPO}[controller]"], capture_output=True, text=True,
                         timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stdout + res.stderr
    resolved = {name(m) for m in re.findall(r"^Requirement already satisfied: (\S+)", res.stdout, re.M)}
    assert {"ansible-core", "paramiko", "matplotlib", "jinja2", "pyyaml"} <= resolved, resolved
    assert not resolved & (TRAINER_ONLY | {"ansible", "ansible-runner"}), resolved


def test_dev_gets_the_controller_and_the_trainer_and_the_trainer_pins_match_the_containers():
    # dev: the controller, the trainer and the trainer's optional MLflow client (its tests log to a server).
    assert "dflash-ops[controller,trainer,mlflow]" in EXTRAS["dev"]
    trainer = {name(r): r for r in EXTRAS["trainer"]}
    containers = yaml.safe_load(CONTAINER_GROUP_VARS.read_text())["dflash_env_requirements"]
    for requirement in containers:
        assert trainer.get(name(requirement)) == requirement, (requirement, trainer)
    assert trainer["torch"] == "torch==2.13.0"
    # The venv's ansible-core is in the range the controller extra admits.
    core = next(r for r in EXTRAS["controller"] if name(r) == "ansible-core")
    installed = subprocess.run([str(VENV_BIN / "python"), "-c", "import ansible; print(ansible.__version__)"],
                               capture_output=True, text=True, check=True).stdout.strip()
    assert installed in Requirement(core).specifier, (core, installed)


def without_trainer_env(tmp_path):
    """The Ansible environment with a sitecustomize that makes every import of the trainer's packages
    fail, in ansible-playbook and in every Python it starts on the controller."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        f"BLOCKED = {sorted(TRAINER_ONLY)!r}\n"
        "class NoTrainer:\n"
        "    def find_spec(self, fullname, path=None, target=None):\n"
        "        if fullname.partition('.')[0] in BLOCKED:\n"
        "            raise ModuleNotFoundError(f'No module named {fullname!r}'\n"
        "                                      ' (a controller without the trainer)')\n"
        "sys.meta_path.insert(0, NoTrainer())\n")
    return ansible_env(PYTHONPATH=str(site))


def test_the_controllers_side_runs_without_the_trainers_packages(tmp_path):
    env = without_trainer_env(tmp_path)
    blocked = subprocess.run([str(VENV_BIN / "python"), "-c", "import torch"], env=env, capture_output=True,
                             text=True)
    assert "a controller without the trainer" in blocked.stderr, blocked.stderr

    # fetch_metrics.yml's plots.
    metrics = tmp_path / "ct200.metrics.jsonl"
    metrics.write_text("".join(json.dumps({"kind": "train", "step": s, "loss": 3.0 - s / 10}) + "\n"
                               for s in range(1, 4)))
    plots = subprocess.run([str(VENV_BIN / "python"), "-m", "dflash_ops.plots", str(metrics), "--out",
                            str(tmp_path / "plots"), "--labels", "ct200"], env=env, cwd=REPO,
                           capture_output=True, text=True, timeout=120)
    assert plots.returncode == 0, plots.stderr
    assert (tmp_path / "plots" / "loss.png").stat().st_size > 0

    # The preflight's filter and lookup plugins (they refuse an inventory without containers), and the
    # containers' connection plugin.
    inventory = tmp_path / "hosts.yml"
    inventory.write_text("all:\n  children:\n    proxmox_hosts:\n      hosts:\n        pve1: {}\n")
    play = subprocess.run([str(VENV_BIN / "ansible-playbook"), "-i", str(inventory),
                           str(REPO / "playbooks" / "status.yml")], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert "has no hosts in group training_containers" in play.stdout, play.stdout + play.stderr
    doc = subprocess.run([str(VENV_BIN / "ansible-doc"), "-t", "connection", "--json",
                          "dflash.ops.pct_pipelined"], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert doc.returncode == 0 and "dflash.ops.pct_pipelined" in doc.stdout, doc.stderr


def test_collections_are_found_in_the_repo_first_then_in_ansibles_default_paths(tmp_path):
    """ansible.cfg's collections_path: the repo's dflash.ops before any installed copy, and the user's
    ~/.ansible/collections (where ansible-galaxy installs community.proxmox for a controller with
    ansible-core alone) still searched."""
    home = tmp_path / "home"
    for collection, version in (("dflash/ops", "0.0.1"), ("example/galaxy", "1.0.0")):
        root = home / ".ansible/collections/ansible_collections" / collection
        (root / "plugins/modules").mkdir(parents=True)
        namespace, cname = collection.split("/")
        (root / "MANIFEST.json").write_text(json.dumps({"collection_info": {
            "namespace": namespace, "name": cname, "version": version}, "file_manifest_file": {}}))
        (root / "plugins/modules/installed_copy.py").write_text(
            'DOCUMENTATION = """\nmodule: installed_copy\nshort_description: An installed copy.\n'
            'description: [An installed copy.]\nauthor: [nobody]\n"""\n')
    env = ansible_env(HOME=str(home))

    def doc(plugin):
        res = subprocess.run([str(VENV_BIN / "ansible-doc"), "--json", plugin], env=env, cwd=REPO,
                             capture_output=True, text=True, timeout=120)
        return json.loads(res.stdout or "{}").get(plugin, {}).get("doc", {})

    # The repo's copy answers for dflash.ops: its modules are found in it, the installed copy's are not.
    repo_module = doc("dflash.ops.proxmox_node_check")
    assert repo_module["filename"].startswith(str(REPO / "ansible_collections")), repo_module
    assert doc("dflash.ops.installed_copy") == {}
    # Another collection installed in ~/.ansible/collections is found.
    assert doc("example.galaxy.installed_copy")["short_description"] == "An installed copy."
