#!/usr/bin/env bash
# `make demo-fleet`: grow a fleet in pvesim. Node pve1 has CT 200 on GPUs 0-3 of its 8; CT 201 is added to
# the inventory with GPUs 4-7, provisioned (check mode first), deployed and seen training, then provisioned
# again with nothing to change. The sim lives under .demo-fleet/ and goes down at the end (DEMO_KEEP=1
# leaves it up: python -m pvesim down --state-dir .demo-fleet/pvesim).
set -euo pipefail
cd "$(dirname "$0")/.."

DIR="$PWD/.demo-fleet"
STATE_DIR="$DIR/pvesim"
INVENTORY="$DIR/inventory"
export ANSIBLE_CONFIG="$PWD/ansible.cfg" ANSIBLE_NOCOLOR=1 ANSIBLE_DEPRECATION_WARNINGS=False
export DFLASH_SIM_ASSETS="$PWD/.demo/assets"

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
on_node() { python -m pvesim ssh --state-dir "$STATE_DIR" pve1 "$@"; }
play() { ansible-playbook -i "$INVENTORY" "$@"; }

if [ "${DEMO_KEEP:-0}" != 1 ]; then
  trap 'step "Take the sim down"; python -m pvesim down --state-dir "$STATE_DIR"' EXIT
fi

step "Bring up node pve1 with CT 200 on GPUs 0-3 of its 8 (GPUs 4-7 free)"
mkdir -p "$INVENTORY"
ln -sfn "$PWD/inventory/sim/group_vars" "$INVENTORY/group_vars"
python - "$STATE_DIR" "$INVENTORY/hosts.yml" <<'PY'
import sys
import pvesim
pvesim.up(nodes=1, containers=(200,), gpus=8, state_dir=sys.argv[1], inventory=sys.argv[2],
          gpu_passthrough={200: [0, 1, 2, 3]})
PY
on_node pct list

step "Add CT 201 to the inventory (it does not exist yet): $INVENTORY/ct201.yml"
python - "$STATE_DIR" "$INVENTORY/ct201.yml" <<'PY'
import sys
import yaml
import pvesim
from pvesim.sim import container_hostvars
sim = pvesim.load(sys.argv[1])
host = {**container_hostvars(sim, "pve1", 201), "proxmox_provision_gpus": [4, 5, 6, 7],
        "proxmox_provision_cores": 4, "proxmox_provision_memory": 8192, "proxmox_provision_rootfs_size": 16}
data = {"all": {"children": {"training_containers": {"hosts": {"ct201": host}}}}}
with open(sys.argv[2], "w") as f:
    f.write("---\n" + yaml.safe_dump(data, sort_keys=False))
PY
grep -E "proxmox_(vmid|provision)" -A4 "$INVENTORY/ct201.yml" | head -n 12

step "What provisioning would do: ansible-playbook playbooks/provision.yml -l ct201 --check --diff"
play playbooks/provision.yml -l ct201 --check --diff | sed -n '/^--- before/,/^PLAY RECAP/p'

step "Provision it: pct create, GPUs 4-7 passed through, python3, NVIDIA's user-space tools, GPU check"
time play playbooks/provision.yml -l ct201 | tail -n 3

step "Its config and the GPUs it sees: pct config 201; pct exec 201 -- nvidia-smi"
on_node pct config 201
on_node pct exec 201 -- nvidia-smi --query-gpu=index,uuid,driver_version --format=csv

step "Deploy to it: ansible-playbook playbooks/deploy.yml -l ct201"
python -m dflash_ops.demo prepare "$DFLASH_SIM_ASSETS" >/dev/null
time play playbooks/deploy.yml -l ct201 | tail -n 3

step "Its run trains: pct exec 201 -- tail -n 2 /var/log/dflash/main.log"
on_node pct exec 201 -- tail -n 2 /var/log/dflash/main.log

step "Provision again: nothing to change"
play playbooks/provision.yml -l ct201 | tail -n 3
