"""docs/PIPELINE.md's table of the stop path's waits says what the trainer, the role and the module
define: every timeout the trainer names (dflash_ops/core/stopping.py) is in it with its value, and so are
the role's and the module's defaults."""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path

import yaml

from ansible_collections.dflash.ops.plugins.modules.training_run import ARGUMENT_SPEC
from dflash_ops.core import stopping
from dflash_ops.run import launcher, transport

REPO = Path(__file__).resolve().parents[2]
ROLE_DEFAULTS = REPO / "ansible_collections/dflash/ops/roles/dflash_run/defaults/main.yml"


def stop_section() -> str:
    text = (REPO / "docs/PIPELINE.md").read_text()
    start = text.index("## Stopping: who waits for what")
    return text[start:text.index("\n## ", start + 1)]


def named_values() -> dict[str, float]:
    """Every "`NAME` = <seconds> s" of the section."""
    return {name: float(value) for name, value in re.findall(r"`(\w+)` = (\d+(?:\.\d+)?) s", stop_section())}


def seconds(value) -> float:
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


def test_every_timeout_the_trainer_names_is_in_the_table_with_its_value():
    table = named_values()
    constants = {name: seconds(value) for name, value in vars(stopping).items()
                 if name.isupper() and not name.startswith("_")}
    assert constants, "dflash_ops/core/stopping.py names no timeout"
    constants.update(POLL_S=transport.POLL_S, POLL_INTERVAL_S=launcher.POLL_INTERVAL_S,
                     MONITOR_INTERVAL_S=launcher.MONITOR_INTERVAL_S)
    assert {name: table.get(name) for name in constants} == constants


def test_the_roles_and_the_modules_defaults_are_the_tables():
    table = named_values()
    defaults = yaml.safe_load(ROLE_DEFAULTS.read_text())
    for key in ("dflash_run_stop_timeout", "dflash_run_kill_timeout", "dflash_run_gpu_timeout"):
        assert table[key] == defaults[key], key
    for key in ("stop_timeout", "kill_timeout"):
        assert table[key] == ARGUMENT_SPEC[key]["default"], key
