"""dflash_release_tree's action plugin turns a release that does not validate into one message: the
trainer's words and the inventory variable to fix (the bad-input table's words come from here); and it
refuses what run.sh would export in the clear under a name that looks like a secret's, unless allowed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ansible_collections.dflash.ops.plugins.action import dflash_release_tree as action
from pvesim.fleet import REPO, VENV_BIN

FIX = {"pipeline.drafter_gpus": "dflash_release_drafter_gpus",
       "pipeline.max_restarts": "dflash_run_max_restarts"}


def failed_validation(stdout="", stderr=""):
    return {"release": "/opt/dflash/releases/0123456789ab", "validated": False,
            "validation": {"dir": "/opt/dflash/releases/.staging-0123456789ab", "rc": 1, "stdout": stdout,
                           "stderr": stderr}}


def test_the_trainers_key_names_the_variable_that_sets_it():
    verdict = {"ok": False, "config": "/x/config.yaml", "key": "pipeline.drafter_gpus[1]",
               "message": "shares GPUs [2] with target_gpus"}
    msg = action.validation_failure("ct200", failed_validation(json.dumps(verdict)), FIX)
    assert msg.startswith("Release 0123456789ab in ct200 does not validate "
                          "(/opt/dflash/releases/.staging-0123456789ab/config.yaml): "
                          "invalid config /x/config.yaml: pipeline.drafter_gpus[1]: shares GPUs [2] with "
                          "target_gpus. "
                          "Fix dflash_release_drafter_gpus in the inventory (or -e)"), msg
    assert msg.endswith("The live release and the running run were left as they were.")


def test_a_key_no_variable_sets_is_a_key_of_the_settings():
    verdict = {"ok": False, "config": "c", "key": "run.save_evry", "message": "unknown key(s) save_evry"}
    msg = action.validation_failure("ct200", failed_validation(json.dumps(verdict)), FIX)
    assert "Fix dflash_release_settings.run.save_evry in the inventory" in msg


def test_an_answer_that_is_not_the_trainers_json_is_shown_as_it_is():
    result = failed_validation(stderr="Traceback ... ImportError: torch\n")
    msg = action.validation_failure("ct201", result, FIX)
    assert ": Traceback ... ImportError: torch. Fix dflash_release_settings.model" in msg


def test_names_that_look_like_secrets_are_the_ones_warned_about():
    environment = {"HF_TOKEN": "x", "wandb_api_key": "x", "DB_Password": "x", "MY_SECRET_ID": "x",
                   "OMP_NUM_THREADS": "4", "NCCL_DEBUG": "INFO", "PYTHONUNBUFFERED": "1"}
    assert action.secret_like_names(environment) == \
        ["DB_Password", "HF_TOKEN", "MY_SECRET_ID", "wandb_api_key"]
    assert action.secret_like_names({}) == action.secret_like_names(None) == []


# The role's build on this machine (connection local): run.sh rendered from the environment, packed, unpacked.
PLAY = """
- hosts: localhost
  gather_facts: false
  tasks:
    - name: Ensure the release is live.
      dflash.ops.dflash_release_tree:
        root: "{dir}/opt"
        build:
          code_dir: "{dir}/pkg"
          dest_dir: "{dir}/build"
          revision: test
          templates:
            run.sh: run.sh.j2
          environment: "{{{{ dflash_release_environment }}}}"
          environment_allowed: "{{{{ dflash_release_environment_allowed }}}}"
"""


def deploy(tmp_path, environment, allowed=None):
    (tmp_path / "pkg").mkdir(exist_ok=True)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "templates").mkdir(exist_ok=True)
    (tmp_path / "templates" / "run.sh.j2").write_text(
        (REPO / "ansible_collections/dflash/ops/roles/dflash_release/templates/run.sh.j2").read_text())
    play = tmp_path / "play.yml"
    play.write_text(PLAY.format(dir=tmp_path))
    variables = tmp_path / "vars.json"
    variables.write_text(json.dumps({"dflash_release_environment": environment,
                                     "dflash_release_environment_allowed": allowed or [],
                                     "dflash_release_venv": "/opt/dflash/venv"}))
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    return subprocess.run([str(VENV_BIN / "ansible-playbook"), "-i", "localhost,", "-c", "local",
                           "-e", f"ansible_python_interpreter={sys.executable}", "-e", f"@{variables}",
                           str(play)], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)


def test_a_deploy_refuses_to_export_a_secret_in_the_clear_unless_the_name_is_allowed(tmp_path):
    res = deploy(tmp_path, {"HF_TOKEN": "hf_not_for_run_sh", "OMP_NUM_THREADS": "4"})
    assert res.returncode != 0, res.stdout + res.stderr
    output = " ".join((res.stdout + res.stderr).split())  # the message's lines wrapped to the terminal
    assert "dflash_release_environment sets HF_TOKEN, which look like secrets" in output, output
    assert "nothing was built or changed" in output and "dflash_run_secret_environment" in output
    assert "ansible-vault create secrets.yml" in output and "dflash_release_environment_allowed" in output
    assert not (tmp_path / "opt").exists() and not (tmp_path / "build").exists()  # nothing built or sent
    assert "hf_not_for_run_sh" not in output
    allowed = deploy(tmp_path, {"TOKENIZERS_PARALLELISM": "false"}, allowed=["TOKENIZERS_PARALLELISM"])
    assert allowed.returncode == 0 and "look like secrets" not in allowed.stdout + allowed.stderr, \
        allowed.stdout + allowed.stderr
    assert "TOKENIZERS_PARALLELISM" in next((tmp_path / "opt" / "releases").glob("*/run.sh")).read_text()
