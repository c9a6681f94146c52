"""dflash_release_tree's action plugin turns a release that does not validate into one message: the
trainer's words and the inventory variable to fix (the bad-input table's words come from here)."""

from __future__ import annotations

import json

from ansible_collections.dflash.ops.plugins.action import dflash_release_tree as action

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
