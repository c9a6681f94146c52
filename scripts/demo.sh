#!/usr/bin/env bash
# `make demo`: bring up pvesim (a local Proxmox with real sshd and real LXC) and show it.
# Runs with the project's venv first on PATH. The demo keeps its own sim under .demo/ and takes it
# down at the end; DEMO_KEEP=1 leaves it up to explore (then: python -m pvesim down --state-dir .demo/pvesim).
set -euo pipefail
cd "$(dirname "$0")/.."

STATE_DIR="$PWD/.demo/pvesim"
INVENTORY="$PWD/.demo/hosts.yml"
export ANSIBLE_CONFIG="$PWD/ansible.cfg" ANSIBLE_NOCOLOR=1 ANSIBLE_DEPRECATION_WARNINGS=False

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
on_node() { python -m pvesim ssh --state-dir "$STATE_DIR" "$@"; }

if [ "${DEMO_KEEP:-0}" != 1 ]; then
  trap 'step "Take the sim down"; python -m pvesim down --state-dir "$STATE_DIR"' EXIT
fi

step "Bring up node pve1 (real sshd on loopback) with container 200 (real LXC) and 8 simulated GPUs"
python -m pvesim up --state-dir "$STATE_DIR" --inventory "$INVENTORY" --nodes 1 --containers 200 --gpus 8

step "The node's containers, as Proxmox lists them: ssh pve1 pct list"
on_node pve1 pct list

step "Ansible reaches the node over ssh and the container through community.proxmox.proxmox_pct_remote"
ansible -i "$INVENTORY" all -m ansible.builtin.ping

step "The GPUs the container sees: ssh pve1 pct exec 200 -- nvidia-smi"
on_node pve1 pct exec 200 -- nvidia-smi --query-gpu=index,uuid,name,memory.used,memory.total,utilization.gpu --format=csv

# ---- The stop-deploy-start story, with the production playbooks against the sim ----
# The sim inventory's group_vars sit next to the demo's hosts.yml; the trainer's code is deployed from
# a copy under .demo/src so that the demo's code change never touches the working tree.
ln -sfn ../inventory/sim/group_vars .demo/group_vars
export DFLASH_SIM_ASSETS="$PWD/.demo/assets"
SRC="$PWD/.demo/src"
rm -rf "$SRC" && mkdir -p "$SRC"
cp -r pyproject.toml dflash_ops "$SRC"/ && { [ ! -f README.md ] || cp README.md "$SRC"/; }
find "$SRC" -name __pycache__ -prune -exec rm -rf {} +
play() { ansible-playbook -i "$INVENTORY" -e "dflash_release_source_dir=$SRC/dflash" "$@"; }
in_ct() { on_node pve1 pct exec 200 -- "$@"; }

step "Prepare the demo target model and data (a tiny Qwen3 trained on the standard library; cached)"
python -m dflash_ops.demo prepare "$DFLASH_SIM_ASSETS"

step "Deploy: node checks, the trainer's venv, a validated release, the run (ansible-playbook playbooks/deploy.yml)"
time play playbooks/deploy.yml

step "The release in the container (nothing of it on the node): pct exec 200 -- ls -l /opt/dflash"
in_ct ls -l /opt/dflash /opt/dflash/current/
in_ct cat /opt/dflash/current/REVISION

step "The run trains: its log (JSON lines) and the GPUs it holds"
sleep 8
in_ct tail -n 3 /var/log/dflash/main.log
in_ct nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv

step "Deploy again with nothing changed: changed=0, the run keeps going"
time (play playbooks/deploy.yml | tail -n 4)

step "Wait for the run's first checkpoint"
for _ in $(seq 60); do in_ct ls /var/lib/dflash/runs/main/checkpoints 2>/dev/null | grep -q step- && break; sleep 2; done
in_ct ls /var/lib/dflash/runs/main/checkpoints
pidfile() { in_ct cat /var/lib/dflash/main.pid | python -c 'import json, sys; d = json.load(sys.stdin); print(d["pid"], d["argv"][0])'; }
read -r old_pid old_cmd < <(pidfile)
echo "the run: pid $old_pid, $old_cmd"

step "A code change (in the demo's copy of the trainer)"
printf '\n# Demo change: deployed by restart_training.yml at %s\n' "$(date -u +%FT%TZ)" >> "$SRC/dflash_ops/train.py"
tail -n 2 "$SRC/dflash_ops/train.py"

step "restart_training.yml --check --diff: what it would do (a new release, a stop, a start); nothing changes"
play playbooks/restart_training.yml --check --diff | grep -E '^(changed|ok: \[ct200\] => \{|    "msg")' | tail -n 6
read -r same_pid _ < <(pidfile)
[ "$same_pid" = "$old_pid" ] || { echo "check mode touched the run ($old_pid -> $same_pid)!"; exit 1; }
echo "the run is still pid $old_pid on $(in_ct readlink /opt/dflash/current)"

step "restart_training.yml: validate the new release, stop (checkpoint), GPUs idle, start from it, health check"
time play playbooks/restart_training.yml

step "The new run: new release, new pid (old pid $old_pid is gone), resumed from the old run's checkpoint"
in_ct readlink /opt/dflash/current
read -r new_pid new_cmd < <(pidfile)
echo "the run: pid $new_pid, $new_cmd"
if in_ct test -d "/proc/$old_pid"; then echo "the old run (pid $old_pid) is still alive!"; exit 1; fi
echo "the old run (pid $old_pid) is gone"
in_ct cat /var/log/dflash/main.log | grep -E '"event": "(checkpoint|stop|resume|start)"' | tail -n 4
sleep 5

step "status.yml: one table for the fleet"
play playbooks/status.yml
