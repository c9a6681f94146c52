"""`ansible-doc -M library <module>` renders, and the documentation matches the argument spec."""

from __future__ import annotations

import importlib
import json
import subprocess

import pytest
import yaml
from module_runner import LIBRARY, VENV_BIN

MODULES = ["training_run", "gpu_verify", "pct_container_check"]


def ansible_doc(*args):
    proc = subprocess.run([str(VENV_BIN / "ansible-doc"), "-M", str(LIBRARY), *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "WARNING" not in proc.stderr and "ERROR" not in proc.stderr, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("name", MODULES)
def test_ansible_doc_renders(name):
    text = ansible_doc(name)
    assert f"MODULE {name}" in text.replace("\x1b[1m", "").replace("\x1b[0m", "")
    assert "OPTIONS" in text and "EXAMPLES" in text and "RETURN VALUES" in text


@pytest.mark.parametrize("name", MODULES)
def test_documented_options_match_the_argument_spec(name):
    doc = json.loads(ansible_doc("--json", name))[name]["doc"]
    spec = importlib.import_module(name).ARGUMENT_SPEC
    assert set(doc["options"]) == set(spec)
    for option, rules in spec.items():
        documented = doc["options"][option]
        assert documented["type"] == rules["type"], option
        assert documented.get("default") == rules.get("default"), option
        assert documented.get("choices") == rules.get("choices"), option
        assert documented.get("elements") == rules.get("elements"), option
        assert bool(documented.get("required")) == bool(rules.get("required")), option
    assert doc["attributes"]["check_mode"]["support"] == "full"


@pytest.mark.parametrize("name", MODULES)
def test_examples_are_valid_yaml_tasks(name):
    examples = yaml.safe_load(importlib.import_module(name).EXAMPLES)
    assert examples and all(name in task for task in examples)
