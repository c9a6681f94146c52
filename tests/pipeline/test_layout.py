"""Pipeline layouts: which workers a config asks for, and the layouts that cannot run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dflash_ops.core.config import ConfigError, PipelineConfig
from dflash_ops.run.launcher import plan_workers, torchrun_command, torchrun_environment
from dflash_ops.run.ranks import rank_table

REPO = Path(__file__).resolve().parents[2]


def test_production_layout_pins_one_gpu_per_worker():
    layout = PipelineConfig(device="cuda", target_gpus=[0, 1, 2, 3, 4], drafter_gpus=[5, 6, 7])
    workers = plan_workers(layout, n_visible_gpus=8)
    assert [(w.name, w.rank, w.gpus) for w in workers] == [
        ("drafter0", 0, (5,)), ("drafter1", 1, (6,)), ("drafter2", 2, (7,)),
        ("target0", 3, (0,)), ("target1", 4, (1,)), ("target2", 5, (2,)), ("target3", 6, (3,)),
        ("target4", 7, (4,)),
    ]
    # Layout indices count within the launcher's own visible GPUs; the worker of local rank r
    # uses cuda:r, so CUDA_VISIBLE_DEVICES lists the layout's GPUs in rank order.
    devices = ["8", "9", "10", "11", "12", "13", "14", "15"]
    env = torchrun_environment(workers, layout, devices)
    assert env["CUDA_VISIBLE_DEVICES"] == "13,14,15,8,9,10,11,12"
    assert "RANK" not in env and "MASTER_ADDR" not in env  # torchrun's to set


def test_torchrun_runs_the_layout_on_loopback_with_the_restart_limit():
    layout = PipelineConfig(target_workers=2, drafter_workers=1, threads_per_worker=1, max_restarts=5)
    command = torchrun_command(layout, "/srv/config.yaml", 3, "/tmp/errors")
    assert command[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    flags = dict(zip(command, command[1:], strict=False))
    assert flags["--nproc-per-node"] == "3" and flags["--max-restarts"] == "5"
    # torchrun keeps each worker's error file there (TORCHELASTIC_ERROR_FILE), for the launcher to read.
    assert flags["--log-dir"] == "/tmp/errors"
    assert command[-4:] == ["-m", "dflash_ops.run.pipeline", "--config", "/srv/config.yaml"]
    assert PipelineConfig().max_restarts == 3


def test_cpu_layout_hides_gpus_and_sets_threads():
    layout = PipelineConfig(target_workers=2, drafter_workers=1, threads_per_worker=1)
    workers = plan_workers(layout, n_visible_gpus=0)
    assert [w.name for w in workers] == ["drafter0", "target0", "target1"]
    env = torchrun_environment(workers, layout, devices=[])
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["OMP_NUM_THREADS"] == "1"
    assert env["GLOO_SOCKET_IFNAME"] == "lo"


MEMBERS = [{"drafters": 1, "targets": 2}, {"drafters": 2, "targets": 1}]


def test_a_run_across_members_numbers_ranks_member_by_member_and_joins_them_at_member_0():
    second = PipelineConfig(device="cuda", target_gpus=[3], drafter_gpus=[0, 1], members=MEMBERS, member=1,
                            rendezvous="10.0.0.5:29400", address="10.0.0.6")
    assert [row[:2] for row in rank_table(second)] == [
        ("drafter0", "drafter"), ("target0", "target"), ("target1", "target"),  # member 0
        ("drafter1", "drafter"), ("drafter2", "drafter"), ("target2", "target")]  # member 1
    # Member 1's local ranks 0, 1, 2 are global ranks 3, 4, 5, on its own GPUs.
    assert [(w.name, w.rank, w.gpus) for w in plan_workers(second, n_visible_gpus=4)] == [
        ("drafter1", 3, (0,)), ("drafter2", 4, (1,)), ("target2", 5, (3,))]
    flags = dict(zip(command := torchrun_command(second, "/c.yaml", 3, "/tmp/e"), command[1:], strict=False))
    assert "--standalone" not in command
    assert (flags["--nnodes"], flags["--rdzv-backend"], flags["--rdzv-endpoint"], flags["--local-addr"]) == (
        "2", "c10d", "10.0.0.5:29400", "10.0.0.6")
    assert flags["--rdzv-conf"] == "is_host=false,join_timeout=600"  # member 0 hosts the rendezvous
    env = torchrun_environment(plan_workers(second, 4), second, ["0", "1", "2", "3"])
    assert "GLOO_SOCKET_IFNAME" not in env  # the LAN's interface is the operator's to name, not loopback


@pytest.mark.parametrize("members, member, message", [
    (MEMBERS, 0, r"members\[0\]: says 1 drafter\(s\) and 2 target\(s\), this member's layout has 1 and 1"),
    (MEMBERS, 2, "member: must be an index into members"),
    ([{"drafters": 0, "targets": 1}, {"drafters": 1, "targets": 1}], 1,
     r"members\[0\].drafters: must be >= 1"),
    ([{"drafters": 1, "gpus": 1}], 0, "must have the keys drafters and targets"),
])
def test_members_that_do_not_fit_are_config_errors(members, member, message):
    with pytest.raises(ConfigError, match=message):
        PipelineConfig(target_workers=1, drafter_workers=1, members=members, member=member,
                       rendezvous="127.0.0.1:29400")


@pytest.mark.parametrize("layout, visible, message", [
    (dict(device="cuda", target_gpus=[0, 1, 2, 3, 4], drafter_gpus=[5, 6, 7]), 4,
     "GPUs [4] do not exist here"),
    (dict(device="cuda", target_gpus=[0, 1], drafter_gpus=[1]), 8, "shares GPUs [1] with target_gpus"),
    (dict(device="cuda", target_gpus=[0, 0], drafter_gpus=[1]), 8, "lists a GPU twice"),
    (dict(device="cuda", target_gpus=[0], drafter_gpus=[]), 8, "at least one drafter GPU"),
    (dict(device="cuda", target_workers=2, drafter_workers=1), 8, "are for device cpu"),
    (dict(device="cpu", target_gpus=[0], drafter_gpus=[1]), 8, "need device cuda"),
    (dict(device="cpu", target_workers=2, drafter_workers=0), 0, "drafter_workers >= 1"),
    (dict(device="cpu", target_workers=1, drafter_workers=1, max_restarts=-1), 0,
     "max_restarts: must be >= 0"),
])
def test_layouts_that_cannot_run_are_config_errors(layout, visible, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        plan_workers(PipelineConfig(**layout), n_visible_gpus=visible)


def test_train_refuses_a_layout_beyond_the_visible_gpus(demo_dir, tmp_path):
    raw = yaml.safe_load((demo_dir / "config.yaml").read_text())
    raw["run"]["output_dir"] = str(tmp_path / "run")
    raw["pipeline"].update(device="cuda", target_gpus=[0, 1], drafter_gpus=[2])
    config = tmp_path / "gpus.yaml"
    config.write_text(yaml.safe_dump(raw))
    result = subprocess.run([sys.executable, "-m", "dflash_ops.train", "--config", str(config)], cwd=REPO,
                            env={"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": "0"},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "do not exist here (1 visible" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()  # refused before anything started
