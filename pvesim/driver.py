"""A node's kernels and NVIDIA driver, and their updates: what `apt full-upgrade` brings (a new
proxmox-kernel, which DKMS builds the driver's module for only when the driver is registered with it),
NVIDIA's installer of another version run on the node (the node's kernel module moves; the containers'
user-space stays where provisioning put it), Secure Boot. The node's tools (pvesim/bin/nvidia-driver-tools:
dkms, dpkg-query, mokutil, nvidia-installer; nvidia-smi and lsmod) read the state this writes, and a boot
(pvesim.node.new_boot) loads the module only when `module_loads`. docs/PVESIM.md lists each behaviour
with its source.

By default a node is set up as the README says: dkms installed and the driver registered with it, built
for its one kernel, Secure Boot off. `set_driver` makes the other nodes (a driver installed without DKMS).
"""

import importlib.machinery
import importlib.util
import shutil

from .host import PACKAGE_BIN

# The kernel a node comes up with (PVE 8.2's), and NVIDIA's driver of `pvesim up` (container.DRIVER_VERSION).
DEFAULT_KERNEL = "6.8.12-4-pve"
TOOLS_FILE = PACKAGE_BIN / "nvidia-driver-tools"
TOOL_NAMES = ("dkms", "dpkg-query", "mokutil", "nvidia-installer")

_loader = importlib.machinery.SourceFileLoader("nvidia_driver_tools", str(TOOLS_FILE))
tools = importlib.util.module_from_spec(importlib.util.spec_from_loader(_loader.name, _loader))
_loader.exec_module(tools)


def state_path(files):
    """The node's driver.json, beside its bin/ (where the node's tools look for it)."""
    return files.bin.parent / "driver.json"


def read(files):
    return tools.read_state(str(state_path(files)))


def write(files, state):
    tools.write_state(state, str(state_path(files)))


def install_node_tools(files, version):
    """The state of a node set up as the README says, and its tools (`node.write_node`)."""
    write(files, {"kernels": [DEFAULT_KERNEL], "running": DEFAULT_KERNEL, "driver": version, "dkms": True,
                  "registered": True, "built": [DEFAULT_KERNEL], "secure_boot": False, "mok_enrolled": False})
    for name in TOOL_NAMES:
        shutil.copyfile(TOOLS_FILE, files.bin / name)
        (files.bin / name).chmod(0o755)


def boot(files):
    """A boot's kernel (the newest installed: the boot loader's default entry) and whether it loads the
    driver's module."""
    state = read(files)
    state["running"] = max(state["kernels"], key=tools.kernel_key)
    write(files, state)
    return tools.module_loads(state)


def user_space_tool(version):
    """The simulated nvidia-smi of NVIDIA's driver `version` (what its installer puts in /usr/bin)."""
    return tools.with_version((PACKAGE_BIN / "nvidia-smi").read_text(), version)


def _files(sim, node_name):
    from . import node
    return node.NodeFiles(sim.state_dir, node_name)


def node_state(sim, node_name):
    """The node's kernels and driver as driver.json has them (installed version, DKMS, Secure Boot)."""
    return read(_files(sim, node_name))


def next_kernel(version):
    """The next ABI of a kernel series: 6.8.12-4-pve -> 6.8.12-5-pve."""
    head, abi, flavour = version.rsplit("-", 2)
    return f"{head}-{int(abi) + 1}-{flavour}"


def kernel_update(sim, node_name, version=None):
    """`apt full-upgrade` bringing a new proxmox-kernel (`version`, else the newest's next ABI): installed
    and the boot loader's default from the next boot; DKMS's kernel hook (/etc/kernel/postinst.d/dkms,
    `dkms autoinstall`) builds the registered driver's module for it, the headers coming with
    proxmox-default-headers. Without DKMS the new kernel has no nvidia.ko. Returns the kernel's version."""
    files = _files(sim, node_name)
    state = read(files)
    version = version or next_kernel(max(state["kernels"], key=tools.kernel_key))
    state["kernels"] = sorted(set(state["kernels"]) | {version}, key=tools.kernel_key)
    if state["registered"]:
        state["built"] = sorted(set(state["built"]) | {version}, key=tools.kernel_key)
    write(files, state)
    return version


def set_driver(sim, node_name, dkms=True, secure_boot=None, mok_enrolled=None):
    """The node's driver as another admin left it: `dkms=False`, installed from NVIDIA's .run on a node
    without the dkms package (not registered, nvidia.ko for the running kernel only); Secure Boot on or
    off, DKMS's signing key enrolled or not."""
    files = _files(sim, node_name)
    state = read(files)
    state["dkms"] = state["registered"] = dkms
    _dkms_tool(files, dkms)
    state["built"] = sorted(set(state["kernels"]) if dkms else {state["running"]}, key=tools.kernel_key)
    if secure_boot is not None:
        state["secure_boot"] = secure_boot
    if mok_enrolled is not None:
        state["mok_enrolled"] = mok_enrolled
    write(files, state)


def install_dkms(sim, node_name):
    """`apt install dkms proxmox-default-headers` on the node: the next run of NVIDIA's installer registers
    the driver with DKMS."""
    files = _files(sim, node_name)
    state = read(files)
    state["dkms"] = True
    _dkms_tool(files, True)
    write(files, state)


def _dkms_tool(files, installed):
    if installed:
        shutil.copyfile(TOOLS_FILE, files.bin / "dkms")
        (files.bin / "dkms").chmod(0o755)
    else:
        (files.bin / "dkms").unlink(missing_ok=True)


def put_installer(sim, node_name, version):
    """NVIDIA's `NVIDIA-Linux-x86_64-<version>.run` downloaded to the node's storage `local` (snippets),
    where the README's commands run it on the node and provisioning takes it into the containers."""
    from .container import nvidia_installer
    path = _files(sim, node_name).snippets / f"NVIDIA-Linux-x86_64-{version}.run"
    path.write_text(nvidia_installer(version))
    path.chmod(0o755)
    return path


def driver_update(sim, node_name, version, *options):
    """NVIDIA's driver `version` downloaded to the node's storage and installed on the node as the README
    says (`sh NVIDIA-Linux-x86_64-<version>.run --dkms --silent`, or `options`); returns ssh's result."""
    path = put_installer(sim, node_name, version)
    return sim.ssh(node_name, f"sh {path} {' '.join(options or ('--dkms', '--silent'))}")
