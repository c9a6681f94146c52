# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# A plugin keeps its imports below its documentation block.
# ruff: noqa: E402
from __future__ import annotations

DOCUMENTATION = r"""
name: waits
type: aggregate
short_description: Say how far a polled wait got, at each retry
description:
  - A task that polls (C(until), C(retries), C(delay)) prints Ansible's C(FAILED - RETRYING) line at each
    retry, which says neither what it waits for nor how far it got. On each retry whose result has
    C(progress) (M(dflash.ops.training_run)'s status of a live run with C(log_path) returns its log's
    last line), this callback prints one more line, with the host and that progress, and what the wait is
    for when the result says it (C(waiting_for), which the status of an async job of
    M(dflash.ops.training_run) returns, names what the call is doing, such as the stop of pid N).
  - Enabled in the project's C(ansible.cfg) (C(callbacks_enabled = dflash.ops.waits)).
version_added: "0.3.0"
author: dflash-ops contributors (@dflash-ops)
requirements:
  - enabled in the C(callbacks_enabled) setting
"""

from ansible.plugins.callback import CallbackBase

from ansible_collections.dflash.ops.plugins.plugin_utils.waits import progress_line


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "dflash.ops.waits"
    CALLBACK_NEEDS_ENABLED = True

    def v2_runner_retry(self, result):
        # ansible-core 2.19 passes a CallbackTaskResult (.result); older versions a TaskResult (._result).
        returned = getattr(result, "result", None)
        if not isinstance(returned, dict):
            returned = getattr(result, "_result", {})
        progress = returned.get("progress")
        if progress:
            host = getattr(result, "host", None) or result._host
            self._display.display(progress_line(host.get_name(), progress, returned.get("waiting_for")))
