"""proxmox_container's reading of the node's GPUs (nvidia-smi on the node, as the caller, never through
sudo) and its messages when nvidia-smi is missing, fails or answers what cannot be read."""

from __future__ import annotations

import pytest
from test_nvidia_smi import DRIVER_NOT_LOADED, NODE_DEVICES

from ansible_collections.dflash.ops.plugins.module_utils.pct_checks import check_gpus_exist, node_gpus
from ansible_collections.dflash.ops.plugins.module_utils.pct_cli import Answer, CheckFailed


class NodeTools:
    """A node whose tools give one recorded answer and remember how they were asked."""

    node = "pve1"

    def __init__(self, answer):
        self.answer, self.asked = answer, []

    def tool(self, program, *args, as_root=True):
        self.asked.append((program, *args, as_root))
        return self.answer


def test_the_node_s_gpus_by_minor_number_with_the_driver():
    tools = NodeTools(Answer(0, NODE_DEVICES, ""))
    gpus = node_gpus(tools)
    assert tools.asked == [("nvidia-smi", "--query-gpu=index,uuid,minor_number,driver_version",
                            "--format=csv,noheader,nounits", False)]
    # GPU 2 has no minor number: no /dev/nvidiaN to pass through.
    assert gpus == [{"index": 0, "uuid": "GPU-aaaa", "minor": 2, "driver": "550.127.05"},
                    {"index": 1, "uuid": "GPU-bbbb", "minor": 3, "driver": "550.127.05"}]
    with pytest.raises(CheckFailed) as failed:
        check_gpus_exist(tools, 205, [3, 4], gpus)
    assert str(failed.value).startswith("CT 205: node pve1 has no GPU 4 (/dev/nvidia4); it has /dev/nvidia2, "
                                        "/dev/nvidia3. Fix proxmox_provision_gpus")


@pytest.mark.parametrize("rc", [None, 126, 127])
def test_a_node_without_nvidia_smi_has_no_gpus(rc):
    assert node_gpus(NodeTools(Answer(rc, "", "nvidia-smi: not found"))) == []


@pytest.mark.parametrize("answer, message", [
    (Answer(9, DRIVER_NOT_LOADED, ""),
     f"nvidia-smi fails on node pve1 (exit 9): {DRIVER_NOT_LOADED.strip()}. Check the NVIDIA driver on the "
     "node before passing its GPUs through."),
    (Answer(0, "0, GPU-aaaa, 2\n", ""),
     "nvidia-smi on node pve1: unexpected nvidia-smi GPU line (want 4 fields): '0, GPU-aaaa, 2'. Check the "
     "NVIDIA driver on the node before passing its GPUs through."),
])
def test_nvidia_smi_failing_on_the_node(answer, message):
    with pytest.raises(CheckFailed) as failed:
        node_gpus(NodeTools(answer))
    assert str(failed.value) == message
