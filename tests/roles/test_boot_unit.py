"""The node's boot unit (the proxmox_host role's dflash-nvidia-devices.service): the README's copy is the
role's template rendered for 8 GPUs, and the unit makes, as nvidia-modprobe makes them
(NVIDIA/nvidia-modprobe, nvidia-modprobe.c main()), every device file a GPU container passes through; the
preflight's device-files item judges a unit by the same rules, and finds the one the README had before
(`nvidia-modprobe -c0 -u` and `-cN`: neither /dev/nvidia0 nor /dev/nvidiactl)."""

import subprocess

import pytest

from ansible_collections.dflash.ops.plugins.module_utils import nvidia_node
from pvesim import prerequisites
from pvesim.fleet import REPO, VENV_BIN, ansible_env
from tests.roles.readme_commands import device_unit, readme_unit

BOOT_DEVICES = REPO / "tests" / "reliability" / "playbooks" / "boot_devices.yml"
UNIT_PATH = "/etc/systemd/system/dflash-nvidia-devices.service"

# The unit's lines before nvidia-modprobe's rules were read from its source (for 2 GPUs).
EARLIER_UNIT = """[Unit]
Before=pve-guests.service
[Service]
Type=oneshot
ExecStart=nvidia-modprobe -c0 -u
ExecStart=nvidia-modprobe -c1
"""


def without_comments(text):
    return [line for line in text.splitlines() if not line.startswith("#")]


def test_the_readme_s_unit_is_the_role_s_template_rendered_for_8_gpus():
    assert without_comments(readme_unit()) == without_comments(device_unit(range(8)))


def test_the_unit_makes_every_file_a_gpu_container_passes_through():
    for minors in ([0], [0, 1], range(8), [2, 5]):
        files = nvidia_node.device_files(minors)
        assert nvidia_node.unit_problems(device_unit(minors), files, list(minors), enabled=True) == [], minors
    files = nvidia_node.device_files([0, 1])
    assert nvidia_node.unit_problems(EARLIER_UNIT, files, [0, 1], enabled=True) == [
        "its ExecStart= lines make none of /dev/nvidia0, /dev/nvidiactl"]


def test_nvidia_modprobe_s_options_make_only_the_files_of_their_minors():
    made = nvidia_node.files_made_by
    assert made(["nvidia-modprobe", "-c0"], [0]) == {"/dev/nvidia0"}
    assert made(["nvidia-modprobe", "-c", "255", "-c=1"], [0, 1]) == {"/dev/nvidiactl", "/dev/nvidia1"}
    assert made(["nvidia-modprobe", "-u", "-c0"], [0]) == {"/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"}
    assert made(["nvidia-modprobe", "-c0", "-u"], [0]) == {"/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"}
    assert made(["nvidia-modprobe", "-u"], [0]) == set()
    assert made(["nvidia-modprobe", "-s", "-c0"], [0]) == set()  # /dev/nvidia-nvswitch0
    assert made(["nvidia-modprobe", "-c256"], [0]) == set()
    assert made(["/usr/bin/nvidia-smi", "-L"], [0, 3]) == {"/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia3"}


def test_the_device_files_item_fails_on_files_missing_before_it_ran_and_on_a_unit_that_makes_too_few():
    def check(item, ok, found, fix):
        return {"item": item, "ok": ok, "found": found, "fix": fix}

    files = nvidia_node.device_files([0, 1])
    good = nvidia_node.check_device_files(check, files, set(files), (device_unit([0, 1]), True))
    assert good["ok"] and good["found"].endswith("dflash-nvidia-devices.service makes them at boot"), good
    check_line = nvidia_node.check_device_files(check, files, set(files[2:]), (EARLIER_UNIT, True))
    assert not check_line["ok"]
    assert check_line["found"] == (
        "not a character device before this check ran nvidia-smi (test -c): /dev/nvidia0, /dev/nvidia1; "
        "the boot unit dflash-nvidia-devices.service: its ExecStart= lines make none of /dev/nvidia0, "
        "/dev/nvidiactl")
    assert check_line["fix"].startswith(
        "make them now: nvidia-modprobe -c255 -c0 -c1 && nvidia-modprobe -u -c0; and at every boot before "
        "the containers start: the unit dflash-nvidia-devices.service with ExecStart=nvidia-modprobe -c255 "
        "-c0 -c1 and ExecStart=nvidia-modprobe -u -c0, Before=pve-guests.service"), check_line["fix"]
    # Not installed (the preflight runs before provision.yml installs it): the files present pass.
    assert nvidia_node.check_device_files(check, files, set(files))["ok"]


@pytest.mark.sim
def test_the_node_play_replaces_an_earlier_unit_and_makes_the_files_at_once(sim_factory):
    """A node that has the earlier unit, enabled: provision.yml's node play rewrites it and restarts it (an
    enabled oneshot that stays active runs again only then), so the files are there before the next boot."""
    s = sim_factory(nodes=1, containers=(376,), gpus=2)
    s.ssh("pve1", f"cat > {UNIT_PATH} <<'EOF'\n{EARLIER_UNIT}[Install]\nWantedBy=multi-user.target\nEOF\n"
                  "systemctl enable --now dflash-nvidia-devices")
    prerequisites.remove_device_nodes(s, "pve1")
    res = subprocess.run([str(VENV_BIN / "ansible-playbook"), "-i", str(s.inventory_path), str(BOOT_DEVICES)],
                         env=ansible_env(), cwd=REPO, capture_output=True, text=True, timeout=300,
                         stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stdout + res.stderr
    assert s.ssh("pve1", f"cat {UNIT_PATH}").stdout == device_unit([0, 1])
    files = nvidia_node.device_files([0, 1])
    present = s.ssh("pve1", f"for f in {' '.join(files)}; do test -c $f && echo $f; done; true").stdout
    assert present.split() == files
