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
