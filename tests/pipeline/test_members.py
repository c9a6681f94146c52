"""A run across two members (two torchrun "containers" as processes on 127.0.0.1, 1 drafter + 1
target each, joined by a c10d rendezvous) trains as the single-member 2 + 2 run does.

Under make test-reliability only (1.5 min of four trainer processes): make test keeps a run across two
containers deployed, training and shown as one through the playbooks (tests/roles/test_run_members.py)."""

from __future__ import annotations

import pytest

from dflash_ops.training.checkpoint import latest_checkpoint, load_checkpoint
from tests.ports import rendezvous_port

STEPS = 4
ONE_MEMBER = {"target_workers": 2, "drafter_workers": 2, "threads_per_worker": 1, "queue_depth": 2}
MEMBER = {"target_workers": 1, "drafter_workers": 1, "threads_per_worker": 1, "queue_depth": 2,
          "members": [{"drafters": 1, "targets": 1}, {"drafters": 1, "targets": 1}]}
LOOPBACK = {"GLOO_SOCKET_IFNAME": "lo"}  # what the operator names on a real LAN: the members' interface


def step_losses(run) -> list[float]:
    return [e["loss"] for e in run.events() if e["event"] == "step"]


@pytest.mark.slow
@pytest.mark.reliability_full
def test_two_members_train_as_one_run_and_resume_from_their_own_checkpoints(write_config, start_run,
                                                                            tmp_path):
    reference = start_run(write_config("reference", optim={"total_steps": STEPS}, pipeline=ONE_MEMBER))
    assert reference.wait(timeout=240) == 0, reference.log_path.read_text()[-3000:]
    expected = step_losses(reference)
    assert len(expected) == STEPS

    endpoint = f"127.0.0.1:{rendezvous_port(str(tmp_path))}"
    configs = [write_config(f"member{i}", optim={"total_steps": STEPS}, run={"max_steps_per_run": STEPS // 2},
                            pipeline={**MEMBER, "member": i, "rendezvous": endpoint, "address": "127.0.0.1"})
               for i in range(2)]
    firsts = [start_run(config, env=LOOPBACK) for config in configs]
    for run in firsts:
        assert run.wait(timeout=240) == 0, run.log_path.read_text()[-3000:]
    # Global ranks member by member: member 0 runs drafter0 and target0, member 1 drafter1 and target1.
    assert [sorted(run.status()["workers"]) for run in firsts] == [
        ["drafter0", "target0"], ["drafter1", "target1"]]
    # Each member logs the run's steps and keeps its own copy of the checkpoint, with both drafters' RNG.
    assert step_losses(firsts[0]) == step_losses(firsts[1]) == expected[:STEPS // 2]
    for run in firsts:
        checkpoint = latest_checkpoint(run.output_dir)
        assert checkpoint.name == f"step-{STEPS // 2:08d}"
        assert len(load_checkpoint(checkpoint)[1]["rng"]) == 2

    seconds = [start_run(config, env=LOOPBACK) for config in configs]
    for run in seconds:
        assert run.wait(timeout=240) == 0, run.log_path.read_text()[-3000:]
        assert [e["step"] for e in run.events() if e["event"] == "resume"] == [STEPS // 2]
        assert run.status()["state"] == "stopped" and run.status()["step"] == STEPS
    # The same batches, target features, DDP averaging and per-drafter RNG: the same losses.
    assert step_losses(firsts[0]) + step_losses(seconds[0]) == expected
    ours = load_checkpoint(latest_checkpoint(seconds[1].output_dir))[0]
    theirs = load_checkpoint(latest_checkpoint(reference.output_dir))[0]
    assert all((ours[k] == theirs[k]).all() for k in theirs)
