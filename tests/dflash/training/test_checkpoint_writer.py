"""Checkpoints written off the step's path (dflash_ops.training.checkpoint_writer): the step waits for
the host copy only, training goes on while the write runs on a thread, at most one write is in flight,
and a stop waits for the write in flight before the run ends, with the same outcome and exit status as
a synchronous save. (A kill mid-write keeps the previous checkpoint: tests/reliability/
test_checkpoint_faults.py.)"""

from __future__ import annotations

import json
import signal
import sys
import threading

import pytest
import torch

from dflash_ops.core.config import config_from_dict
from dflash_ops.core.runtime import StopSignal
from dflash_ops.run.main import run_single_process
from dflash_ops.training import drafter_run
from dflash_ops.training.checkpoint import list_checkpoints, load_checkpoint, step_of
from dflash_ops.training.checkpoint_writer import CheckpointWriter
from dflash_ops.training.trainer import DrafterTrainer
from tests.waiting import wait_for

HOLD_S = 60  # how long a held write waits for what it waits for; only a failing run waits that long


def events(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def held_writes(monkeypatch, held_step: int, until) -> list[tuple]:
    """Wrap the run's checkpoint writes: the write of `held_step` waits (at most HOLD_S) until `until()`
    holds; each write records (step, whether it ran on the main thread, whether the wait was met)."""
    writes: list[tuple] = []
    real = drafter_run.save_checkpoint

    def save(output_dir, step, *args, **kwargs):
        met = wait_for(until, timeout=HOLD_S, interval=0.01) if step == held_step else True
        writes.append((step, threading.current_thread() is threading.main_thread(), bool(met)))
        return real(output_dir, step, *args, **kwargs)

    monkeypatch.setattr(drafter_run, "save_checkpoint", save)
    return writes


def test_the_run_trains_on_while_its_checkpoint_is_written(tiny_config, tmp_path, monkeypatch, capsys):
    trained = []
    real_step = DrafterTrainer.accumulated_step

    def step(self, batches):
        result = real_step(self, batches)
        trained.append(self.step)
        return result

    monkeypatch.setattr(DrafterTrainer, "accumulated_step", step)
    # The write of step 2 is held until step 4 has trained: a synchronous save would hold the step too.
    writes = held_writes(monkeypatch, 2, lambda: 4 in trained)
    raw = tiny_config(tmp_path / "out", optim={"total_steps": 6}, run={"save_every": 2, "log_every": 1})
    capsys.readouterr()
    assert run_single_process(config_from_dict(raw)) == 0
    log = events(capsys.readouterr().out)
    assert writes == [(2, False, True), (4, False, True), (6, False, True)]
    assert [e["step"] for e in log if e["event"] == "checkpoint"] == [2, 4, 6]
    # Step 2's checkpoint is logged once written, after the steps that trained meanwhile.
    order = [(e["event"], e["step"]) for e in log if e["event"] in ("step", "checkpoint")]
    assert order.index(("checkpoint", 2)) > order.index(("step", 4))
    assert [step_of(p) for p in list_checkpoints(tmp_path / "out")] == [4, 6]
    _, state, meta = load_checkpoint(list_checkpoints(tmp_path / "out")[-1])
    assert meta["step"] == state["trainer"]["step"] == 6
    assert not [t for t in threading.enumerate() if t.name.startswith("checkpoint-")]


def test_a_stop_waits_for_the_write_in_flight_and_ends_as_a_synchronous_save_would(
        tiny_config, tmp_path, monkeypatch, capsys):
    stop = StopSignal()
    main = threading.main_thread()

    def training_thread_waits_for_the_write() -> bool:
        frame = sys._current_frames().get(main.ident)
        while frame is not None:
            if frame.f_code.co_name == "join":
                return True
            frame = frame.f_back
        return False

    def until() -> bool:
        stop._handle(signal.SIGTERM, None)  # SIGTERM while step 2 is being written
        return training_thread_waits_for_the_write()

    writes = held_writes(monkeypatch, 2, until)
    raw = tiny_config(tmp_path / "out", optim={"total_steps": 50}, run={"save_every": 2, "log_every": 1})
    capsys.readouterr()
    assert run_single_process(config_from_dict(raw), stop) == 0
    log = events(capsys.readouterr().out)
    last = [e["step"] for e in log if e["event"] == "step"][-1]
    assert writes[0] == (2, False, True)  # held until the run, stopped, waited for it
    checkpoints = [e["step"] for e in log if e["event"] == "checkpoint"]
    assert checkpoints[0] == 2 and checkpoints[-1] == last
    assert log[-1]["event"] == "stop" and log[-1]["reason"] == "signal SIGTERM"
    assert step_of(list_checkpoints(tmp_path / "out")[-1]) == last
    status = json.loads((tmp_path / "out" / "status.json").read_text())
    assert (status["state"], status["step"]) == ("stopped", last)


def test_the_final_save_writes_the_state_as_it_is_without_a_host_copy(tiny_config, tmp_path, monkeypatch,
                                                                       capsys):
    copies = []
    real = CheckpointWriter.snapshot

    def snapshot(self, state):
        copies.append(state)
        return real(self, state)

    monkeypatch.setattr(CheckpointWriter, "snapshot", snapshot)
    raw = tiny_config(tmp_path / "out", optim={"total_steps": 3}, run={"save_every": 1000})
    capsys.readouterr()
    assert run_single_process(config_from_dict(raw)) == 0
    # Nothing trains after it: no copy of the state is held (a CPU run's memory is the device's).
    assert copies == [] and [step_of(p) for p in list_checkpoints(tmp_path / "out")] == [3]
    assert [e["step"] for e in events(capsys.readouterr().out) if e["event"] == "checkpoint"] == [3]


def test_the_host_copy_is_the_state_at_the_save_whatever_the_step_does_after_and_its_buffers_are_reused():
    writer = CheckpointWriter()
    weight, moment = torch.arange(6.0).reshape(2, 3), torch.ones(4)
    optimizer = {"state": {0: {"exp_avg": moment, "step": torch.tensor(3.0)}},
                 "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0]}]}
    state = {"w": weight.t(), "optimizer": optimizer, "rng": [{"python": (3, (1, 2), None)}]}
    copied = writer.snapshot(state)
    weight.add_(100)
    moment.mul_(7)  # the optimizer's next step, in place
    assert torch.equal(copied["w"], torch.arange(6.0).reshape(2, 3).t())
    assert torch.equal(copied["optimizer"]["state"][0]["exp_avg"], torch.ones(4))
    assert copied["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    assert copied["rng"] == [{"python": (3, (1, 2), None)}]
    seen = []
    writer.start(1, lambda: seen.append(copied) or "path-1")
    with pytest.raises(RuntimeError, match="in flight"):
        writer.snapshot(state)  # the buffers are the write's until it is done
    with pytest.raises(RuntimeError, match="in flight"):
        writer.start(2, lambda: "path-2")
    assert writer.wait() == "path-1" and seen == [copied]
    again = writer.snapshot(state)
    assert again["optimizer"]["state"][0]["exp_avg"] is copied["optimizer"]["state"][0]["exp_avg"]
    assert torch.equal(again["optimizer"]["state"][0]["exp_avg"], torch.full((4,), 7.0))


def test_a_failed_write_is_raised_to_the_training_thread():
    writer = CheckpointWriter()

    def full_disk():
        raise OSError(28, "No space left on device")

    writer.start(3, full_disk)
    with pytest.raises(OSError, match="No space"):
        writer.wait()
    assert not writer.in_flight and writer.wait() is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_device_state_is_copied_into_pinned_host_buffers():
    writer = CheckpointWriter()
    device_state = {"w": torch.randn(1024, 1024, device="cuda")}
    copied = writer.snapshot(device_state)
    assert copied["w"].device.type == "cpu" and copied["w"].is_pinned()
    assert torch.equal(copied["w"], device_state["w"].cpu())
