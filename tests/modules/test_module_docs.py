"""`ansible-doc` renders every plugin of the dflash.ops collection, and each module's documentation
matches its argument spec."""

from __future__ import annotations

import importlib
import inspect
import json
import subprocess

import pytest
import yaml
from module_runner import REPO, VENV_BIN

PLUGINS = "ansible_collections.dflash.ops.plugins"
# the modules that show --diff (config lines, rendered files)
DIFF_MODE = {"proxmox_container", "dflash_release_tree"}
# Every module of the collection: a new one is checked without being listed here.
MODULES = sorted(p.stem for p in (REPO / PLUGINS.replace(".", "/") / "modules").glob("*.py")
                 if p.stem != "__init__")


def ansible_doc(*args):
    proc = subprocess.run([str(VENV_BIN / "ansible-doc"), *args], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env={"PATH": f"{VENV_BIN}:/usr/bin:/bin",
                                         "ANSIBLE_CONFIG": str(REPO / "ansible.cfg")})
    assert proc.returncode == 0, proc.stderr
    assert "WARNING" not in proc.stderr and "ERROR" not in proc.stderr, proc.stderr
    return proc.stdout


def plain(text):
    return text.replace("\x1b[1m", "").replace("\x1b[0m", "")


@pytest.mark.parametrize("name", MODULES)
def test_ansible_doc_renders(name):
    text = plain(ansible_doc(f"dflash.ops.{name}"))
    assert f"MODULE dflash.ops.{name}" in text
    assert "OPTIONS" in text and "EXAMPLES" in text and "RETURN VALUES" in text


@pytest.mark.parametrize("name", MODULES)
def test_documented_options_match_the_argument_spec(name):
    doc = json.loads(ansible_doc("--json", f"dflash.ops.{name}"))[f"dflash.ops.{name}"]["doc"]
    spec = importlib.import_module(f"{PLUGINS}.modules.{name}").ARGUMENT_SPEC
    assert set(doc["options"]) == set(spec)
    for option, rules in spec.items():
        documented = doc["options"][option]
        assert documented["type"] == rules["type"], option
        assert documented.get("default") == rules.get("default"), option
        assert documented.get("choices") == rules.get("choices"), option
        assert documented.get("elements") == rules.get("elements"), option
        assert bool(documented.get("required")) == bool(rules.get("required")), option
    # The collection's doc fragment supplies diff_mode and platform; each module states its check_mode.
    assert doc["attributes"]["check_mode"]["support"] == "full"
    assert doc["attributes"]["diff_mode"]["support"] == ("full" if name in DIFF_MODE else "none")
    assert doc["attributes"]["platform"]["platforms"] == "posix"


@pytest.mark.parametrize("name", MODULES)
def test_examples_are_valid_yaml_tasks_calling_the_module_by_its_full_name(name):
    examples = yaml.safe_load(importlib.import_module(f"{PLUGINS}.modules.{name}").EXAMPLES)
    assert any(f"dflash.ops.{name}" in task for task in examples)
    assert not any(name in task for task in examples), "an example calls the module by its short name"


def test_the_connection_renders_with_the_collections_options_plus_pipelining():
    """pct_pipelined's DOCUMENTATION is a literal (ansible-doc reads it without importing the plugin); its
    options must stay those of community.proxmox's proxmox_pct_remote, with pipelining added and pty off."""
    upstream = importlib.import_module(
        "ansible_collections.community.proxmox.plugins.connection.proxmox_pct_remote")
    ours = importlib.import_module(f"{PLUGINS}.connection.pct_pipelined")
    text = plain(ansible_doc("-t", "connection", "dflash.ops.pct_pipelined"))
    assert "dflash.ops.pct_pipelined" in text and "pipelining" in text
    doc = json.loads(ansible_doc("-t", "connection", "--json", "dflash.ops.pct_pipelined"))
    options = doc["dflash.ops.pct_pipelined"]["doc"]["options"]
    upstream_options = yaml.safe_load(upstream.DOCUMENTATION)["options"]
    assert set(options) == set(upstream_options) | {"pipelining"}
    for name, spec in upstream_options.items():
        if name != "pty":
            assert yaml.safe_load(ours.DOCUMENTATION)["options"][name] == spec, name
    assert options["pty"]["default"] is False and options["pipelining"]["default"] is True


def test_the_lookup_renders_with_its_options():
    doc = json.loads(ansible_doc("-t", "lookup", "--json", "dflash.ops.role_argument_spec"))
    options = doc["dflash.ops.role_argument_spec"]["doc"]["options"]
    assert set(options) == {"_terms", "entry_point"} and options["entry_point"]["default"] == "main"
    examples = yaml.safe_load(importlib.import_module(f"{PLUGINS}.lookup.role_argument_spec").EXAMPLES)
    assert "dflash.ops.role_argument_spec" in json.dumps(examples)


def test_the_preflight_filter_renders_with_an_option_for_each_parameter_and_its_checks():
    text = plain(ansible_doc("-t", "filter", "dflash.ops.preflight"))
    assert "dflash.ops.preflight" in text and "EXAMPLES" in text and "RETURN VALUES" in text
    rendered = json.loads(ansible_doc("-t", "filter", "--json", "dflash.ops.preflight"))
    doc = rendered["dflash.ops.preflight"]["doc"]
    plugin = importlib.import_module(f"{PLUGINS}.filter.preflight")
    parameters = list(inspect.signature(plugin.preflight).parameters)
    assert set(doc["options"]) == {"_input", *parameters[1:]}  # the first parameter is the filter's input
    assert doc["options"]["check"]["choices"] == list(plugin.CHECKS)
    examples = yaml.safe_load(plugin.EXAMPLES)
    assert "dflash.ops.preflight(" in json.dumps(examples)
