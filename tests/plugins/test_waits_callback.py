"""The dflash.ops.waits callback: a task polling a live run with training_run's status prints, at each
retry, the host and the last line of the run's log, so a long wait says how far it got."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ansible_collections.dflash.ops.plugins.plugin_utils.waits import MAX_PROGRESS, progress_line
from pvesim.fleet import REPO, VENV_BIN

FAKE_RUN = str(REPO / "tests" / "modules" / "fixtures" / "fake_run.py")

PLAY = """
- hosts: localhost
  gather_facts: false
  tasks:
    - name: Start a run that logs a step.
      dflash.ops.training_run:
        name: waited
        pidfile: "{dir}/waited.pid"
        log_path: "{dir}/waited.log"
        command: ["{python}", "{fake_run}", "--step-after", "0"]
        chdir: "{dir}"
        wait_for: '"event": *"step"'
    - name: Wait for a run that never ends (three polls).
      dflash.ops.training_run:
        name: waited
        pidfile: "{dir}/waited.pid"
        log_path: "{dir}/waited.log"
        state: status
      register: polled
      until: polled.status != 'running'
      retries: 2
      delay: 0
      ignore_errors: true
    - name: Stop the run.
      dflash.ops.training_run:
        name: waited
        pidfile: "{dir}/waited.pid"
        state: stopped
        stop_timeout: 10
"""


def test_progress_line_is_one_line_and_bounded():
    line = progress_line("ct200", "a\nb " + "x" * 1000)
    assert "\n" not in line and line.startswith("    ct200: still waiting; last: a b ")
    assert len(line) - len("    ct200: still waiting; last: ") == MAX_PROGRESS


@pytest.mark.parametrize("enabled", [True, False])
def test_each_retry_of_a_polled_wait_says_the_runs_last_log_line(tmp_path, enabled):
    play = tmp_path / "play.yml"
    play.write_text(PLAY.format(dir=tmp_path, python=sys.executable, fake_run=FAKE_RUN))
    config = REPO / "ansible.cfg"
    if not enabled:  # the project's settings without the callback
        text = config.read_text()
        assert "callbacks_enabled = dflash.ops.waits\n" in text
        config = tmp_path / "ansible.cfg"
        config.write_text(text.replace("callbacks_enabled = dflash.ops.waits\n", "")
                          .replace("collections_path = .", f"collections_path = {REPO}"))
    env = dict(os.environ, ANSIBLE_CONFIG=str(config), ANSIBLE_NOCOLOR="1",
               PATH=f"{VENV_BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}")
    res = subprocess.run([str(Path(VENV_BIN) / "ansible-playbook"), "-i", "localhost,", "-c", "local",
                          "-e", f"ansible_python_interpreter={sys.executable}", str(play)],
                         env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    waits = [line for line in res.stdout.splitlines() if "still waiting; last:" in line]
    assert res.stdout.count("FAILED - RETRYING") == 2
    if enabled:
        assert len(waits) == 2 and all('"event": "step"' in line for line in waits), res.stdout
    else:
        assert waits == []
