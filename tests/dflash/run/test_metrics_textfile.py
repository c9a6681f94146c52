"""The run's Prometheus metrics (dflash_ops.run.metrics): the file follows the run's log beside status.json,
in the text format Prometheus's own parser accepts (`promtool check metrics`), written atomically, with
the deploy's labels and the run's member; off without run.metrics_textfile_dir."""

from __future__ import annotations

import subprocess
import threading
import time

import pytest

from dflash_ops.core.sections import RunConfig
from dflash_ops.run.metrics import RunMetrics, mountpoint_of, smi_gpus
from dflash_ops.run.status import RunStatus
from tests.prometheus.tools import prometheus_program
from tests.waiting import wait_for

LABELS = {"container": "ct200", "node": "pve1", "run": "main"}
PIPELINE = [{"event": "launch"},
            {"event": "worker_start", "worker": "drafter0", "pid": 11, "gpus": [3]},
            {"event": "worker_start", "worker": "target0", "pid": 12, "gpus": [0]},
            {"event": "start", "worker": "drafter0"},
            {"event": "restart", "restart": 1, "cause": "worker target0 was killed by SIGKILL"},
            {"event": "worker_start", "worker": "drafter0", "pid": 21, "gpus": [3]},
            {"event": "worker_start", "worker": "target0", "pid": 22, "gpus": [0]},
            {"event": "start", "worker": "drafter0"},
            {"event": "step", "worker": "drafter0", "step": 40, "loss": 2.5, "tokens_per_s": 900.0,
             "samples_per_s": 3.5, "time": 1000.0},
            {"event": "checkpoint", "worker": "drafter0", "step": 40, "path": "/run/step-00000040",
             "time": 1001.0},
            {"event": "heldout", "worker": "drafter0", "heldout_loss": 2.0, "heldout_tau": 3.25},
            {"event": "balance", "target_wait": 0.125, "drafter_wait": 0.5, "bound": "target-bound"}]


def samples(text: str) -> dict[str, float]:
    """{'name{labels}': value} of an exposition's sample lines."""
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def labelled(name: str, **extra) -> str:
    labels = {**LABELS, "member": "0", **extra}
    return "dflash_run_" + name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def fake_gpus(indices):
    return {i: {"memory": 1024.0 * (i + 1), "utilization": 0.5} for i in indices}


def test_the_file_follows_the_run_in_prometheus_text_format(tmp_path):
    textfiles = tmp_path / "textfile"
    textfiles.mkdir()
    metrics = RunMetrics(textfiles, LABELS, member=0, output_dir=str(tmp_path / "run"), gpus=fake_gpus)
    status = RunStatus(tmp_path / "run", metrics=metrics)
    for record in PIPELINE:
        status.follow(record)
    metrics.beat()  # the heartbeat's read of the GPUs
    metrics.close()
    assert [p.name for p in textfiles.iterdir()] == ["dflash_main_0.prom"]  # no temporary file left
    text = metrics.path.read_text()
    shown = samples(text)
    assert shown[labelled("state", state="running")] == 1 and shown[labelled("state", state="failed")] == 0
    assert shown[labelled("step")] == 40 and shown[labelled("last_step_timestamp_seconds")] == 1000.0
    assert (shown[labelled("samples_per_second")], shown[labelled("tokens_per_second")]) == (3.5, 900.0)
    assert (shown[labelled("loss")], shown[labelled("heldout_tau")]) == (2.5, 3.25)
    assert shown[labelled("last_checkpoint_step")] == 40
    assert shown[labelled("last_checkpoint_timestamp_seconds")] == 1001.0
    assert shown[labelled("torchrun_restarts_total")] == 1
    assert shown[labelled("balance_wait_ratio", role="drafter")] == 0.5
    assert shown[labelled("gpu_memory_used_bytes", gpu="0")] == 1024.0
    assert shown[labelled("gpu_utilization_ratio", gpu="3")] == 0.5
    assert abs(shown[labelled("heartbeat_timestamp_seconds")] - time.time()) < 60
    output = {"output_dir": tmp_path / "run", "mountpoint": mountpoint_of(tmp_path)}
    assert shown[labelled("output_info", **output)] == 1
    promtool = prometheus_program("promtool")
    check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_a_scrape_never_reads_half_a_file(tmp_path):
    metrics = RunMetrics(tmp_path, {**LABELS, "note": "x" * 20000}, output_dir=str(tmp_path),
                         heartbeat_s=0.01)  # the heartbeat writes too
    metrics.follow(PIPELINE[1], {"state": "running"})
    last = metrics.path.read_text().splitlines()[-1] + "\n"  # dflash_run_output_info, the file's end
    seen, done = [], threading.Event()

    def read():
        while not done.is_set():
            seen.append(metrics.path.read_text())

    reader = threading.Thread(target=read)
    reader.start()
    for step in range(200):
        metrics.follow({"event": "step", "step": step, "time": 5.0}, {"state": "running", "step": step})
    done.set()
    reader.join()
    metrics.close()
    assert seen and all(text.endswith(last) for text in seen)


def test_the_heartbeat_rewrites_a_live_run_and_leaves_an_ended_one(tmp_path):
    metrics = RunMetrics(tmp_path, LABELS, heartbeat_s=0.05)
    metrics.follow({"event": "start"}, {"state": "running"})
    beat = samples(metrics.path.read_text())[labelled("heartbeat_timestamp_seconds")]
    deadline = time.time() + 30
    while samples(metrics.path.read_text())[labelled("heartbeat_timestamp_seconds")] == beat:
        assert time.time() < deadline, "no heartbeat"
        time.sleep(0.05)
    metrics.follow({"event": "exit", "returncode": 0}, {"state": "stopped"})
    metrics.thread.join(timeout=30)
    assert not metrics.thread.is_alive()
    metrics.close()


def test_off_without_a_directory(tmp_path):
    assert RunMetrics.of(RunConfig(output_dir=str(tmp_path))) is None
    on = RunMetrics.of(RunConfig(output_dir=str(tmp_path / "runs" / "b"), metrics_textfile_dir=str(tmp_path)),
                       member=1)
    assert on.labels == {"run": "b", "member": "1"} and on.path == tmp_path / "dflash_b_1.prom"


SMI = """0, GPU-aaaa, 70000, 95
1, GPU-bbbb, 512, 0
2, GPU-cccc, [N/A], [N/A]
3, GPU-dddd, 100, 7
"""


def test_the_gpus_are_the_runs_as_nvidia_smi_reports_them_and_none_without_it(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    assert smi_gpus([0]) == {}  # no nvidia-smi: a CPU machine
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + "".join(f"printf '%s\\n' '{row}'\n" for row in SMI.splitlines()))
    smi.chmod(0o755)
    # The run's GPUs 0..2 are the launcher's visible entries: a UUID, then nvidia-smi indices.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-dddd,1,2")
    assert smi_gpus([0, 1, 2]) == {0: {"memory": 100 * 2**20, "utilization": 0.07},
                                   1: {"memory": 512 * 2**20, "utilization": 0.0}}  # 2: no figures


def test_the_gpus_are_read_by_the_heartbeat_never_on_the_steps_path(tmp_path):
    readers = []
    metrics = RunMetrics(tmp_path, LABELS, heartbeat_s=3600,
                         gpus=lambda held: readers.append(threading.current_thread()) or fake_gpus(held))
    fields = {"state": "running", "workers": {"d": {"gpus": [0, 1]}}}
    for step in range(5):
        metrics.follow({"event": "step", "step": step}, fields)
    assert wait_for(lambda: readers, timeout=30)  # the heartbeat's first beat
    assert readers == [metrics.thread] and metrics.thread is not threading.current_thread()
    assert wait_for(lambda: 'gpu="1"' in metrics.path.read_text(), timeout=30)
    metrics.close()


@pytest.mark.parametrize("labels", [{"bad-name": "x"}, {"member": "2"}, {"run": ["a"]}])
def test_bad_labels_are_refused_by_the_config(tmp_path, labels):
    with pytest.raises(Exception, match="run.metrics_labels"):
        RunConfig(output_dir=str(tmp_path), metrics_labels=labels)


def test_a_directory_that_cannot_be_written_costs_the_metrics_not_the_run(tmp_path, capsys):
    metrics = RunMetrics(tmp_path / "missing", LABELS, heartbeat_s=3600)
    status = RunStatus(tmp_path / "run", metrics=metrics)
    for record in PIPELINE:
        status.follow(record)
    metrics.close()
    assert capsys.readouterr().err.count("metrics: cannot write") == 1
    assert not (tmp_path / "missing").exists()
