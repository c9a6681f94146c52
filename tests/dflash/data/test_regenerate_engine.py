"""Regeneration on engines in processes of their own (`dflash_ops.data.regenerate_engine`), here transformers'
engine behind the protocol vLLM's runs behind (`dflash_ops.data.engine_worker`; vLLM itself:
tests/serving/test_vllm_regenerate.py, `make regenerate-check`): rows as the in-process path writes them,
an engine killed mid-job reported with its exit and the rows kept for the next call, a stop that ends the
engine, and the refusals that come before anything starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_ops.data.data_manifest import manifest_path
from dflash_ops.data.regenerate import GenerationSettings, parts_record_path, read_rows, regenerate
from tests.dflash.data.test_regenerate_stop import REPO, chat_target, write_prompts

SETTINGS = GenerationSettings(4, batch_size=2)
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return chat_target(tmp_path_factory.mktemp("regenerate-engine"))


def cli(target: str, prompts: str, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "dflash_ops.data", "regenerate", "--target", target, "--prompts", prompts,
            "--out", str(out), "--dtype", "float32", "--max-length", "256", *extra]


def engine_pids(parent: int) -> list[int]:
    """The children of `parent` (the engines it started), from /proc."""
    children = Path(f"/proc/{parent}/task/{parent}/children")
    return [int(pid) for pid in children.read_text().split()] if children.exists() else []


def lines_until(process: subprocess.Popen, event: str) -> dict:
    for line in process.stdout:
        record = json.loads(line)
        if record["event"] == event:
            return record
    raise AssertionError(f"no {event} line; stderr: {process.stderr.read()}")


def test_engine_processes_write_the_rows_the_in_process_path_writes(target, tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 9)
    alone, engines = tmp_path / "alone.jsonl", tmp_path / "engines.jsonl"
    regenerate(target, prompts, str(alone), SETTINGS)
    summary = regenerate(target, prompts, str(engines), SETTINGS, replicas=2, engine_python=sys.executable)
    assert summary["rows"] == summary["generated"] == 9 and summary["engine"] == "hf"
    assert summary["output_tokens"] == sum(sum(row["loss_mask"]) for row in read_rows(engines).values())
    assert engines.read_text() == alone.read_text()
    assert json.loads(manifest_path(engines).read_text())["generation"]["engine"] == "hf"
    assert not list(tmp_path.glob("engines.jsonl.*log")) and not parts_record_path(engines).exists()


def test_an_engine_killed_mid_job_ends_the_call_clearly_and_the_next_call_resumes(target, tmp_path):
    prompts, out = write_prompts(tmp_path / "prompts.jsonl", 120), tmp_path / "train.jsonl"
    command = cli(target, prompts, out, "--engine", "hf", "--engine-python", sys.executable,
                  "--batch-size", "1", "--max-new-tokens", "3", "--progress-every", "1")
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=ENV)
    assert lines_until(process, "engine")["engine"] == "hf"
    lines_until(process, "progress")
    [engine] = engine_pids(process.pid)
    os.kill(engine, signal.SIGKILL)  # an out-of-memory kill, say
    _, err = process.communicate(timeout=120)
    assert process.returncode == 2
    assert "the engine of replica 0 ended (killed by SIGKILL)" in err and "run the same command again" in err
    kept = read_rows(out.with_name("train.jsonl.part-0"))
    assert 1 <= len(kept) < 120 and not manifest_path(out).exists()
    again = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=ENV, timeout=300)
    assert again.returncode == 0, again.stderr
    done = json.loads(again.stdout.splitlines()[-1])
    assert done["event"] == "regenerated" and done["rows"] == 120 and done["skipped_done"] == len(kept)
    rows = read_rows(out)
    assert all(rows[index] == row for index, row in kept.items())  # the rows kept are the rows merged


def test_a_stop_ends_the_engine_keeps_the_rows_and_exits_0(target, tmp_path):
    prompts, out = write_prompts(tmp_path / "prompts.jsonl", 400), tmp_path / "train.jsonl"
    status = tmp_path / "job.status.json"
    process = subprocess.Popen(cli(target, prompts, out, "--engine", "hf", "--engine-python", sys.executable,
                                   "--batch-size", "1", "--max-new-tokens", "3", "--progress-every", "1",
                                   "--status-file", str(status)),
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    lines_until(process, "progress")
    assert json.loads(status.read_text())["state"] == "running"
    [engine] = engine_pids(process.pid)
    process.send_signal(signal.SIGTERM)
    rest, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    stopped = json.loads(rest.splitlines()[-1])
    assert stopped["event"] == "stopped" and 1 <= stopped["rows"] < 400
    assert len(read_rows(out.with_name("train.jsonl.part-0"))) == stopped["rows"]
    assert not Path(f"/proc/{engine}").exists()  # reaped: no engine left behind
    # What a container's boot reads: stopped by a signal, so started again (a run's status.json rules).
    assert json.loads(status.read_text())["stop_reason"] == "signal SIGTERM"


def test_a_prompt_over_the_bound_is_skipped_and_counted(target, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    chats = [[{"role": "user", "content": "w1 " * (300 if i == 3 else 2)}] for i in range(6)]
    prompts.write_text("".join(json.dumps(chat) + "\n" for chat in chats))
    out = tmp_path / "train.jsonl"
    summary = regenerate(target, str(prompts), str(out), SETTINGS, max_length=64,
                         engine_python=sys.executable)
    assert summary["skipped_too_long"] == 1 and summary["rows"] == 5 and 3 not in read_rows(out)
    # The answers end within the bound: prompt and answer fit max_length.
    assert all(len(row["input_ids"]) <= 64 for row in read_rows(out).values())


def test_refusals_come_before_anything_is_written(target, tmp_path):
    prompts, out = write_prompts(tmp_path / "prompts.jsonl", 3), tmp_path / "train.jsonl"
    no_vllm = subprocess.run(cli(target, prompts, out, "--engine", "vllm", "--engine-python", sys.executable),
                             cwd=REPO, capture_output=True, text=True, env=ENV, timeout=120)
    assert no_vllm.returncode == 2 and f"--engine vllm: no vLLM in {sys.executable}" in no_vllm.stderr
    positions = json.loads((Path(target) / "config.json").read_text())["max_position_embeddings"]
    status = tmp_path / "status.json"
    too_long = subprocess.run(cli(target, prompts, out, "--engine", "hf")[:-2]
                              + ["--max-length", str(positions + 1), "--status-file", str(status)],
                              cwd=REPO, capture_output=True, text=True, env=ENV, timeout=120)
    assert too_long.returncode == 2
    assert f"--max-length {positions + 1} is over the target's max_position_embeddings ({positions})" \
        in too_long.stderr
    failed = json.loads(status.read_text())  # a failed job: a container's boot leaves it so
    assert failed["state"] == "failed" and "--max-length" in failed["error"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["prompts.jsonl", "status.json"]


@pytest.mark.parametrize("given", [None, "hf"])
def test_auto_without_vllm_is_transformers_and_says_so(target, tmp_path, given):
    prompts, out = write_prompts(tmp_path / "prompts.jsonl", 2), tmp_path / "train.jsonl"
    status = tmp_path / "status.json"
    extra = (["--engine", given] if given else []) + ["--status-file", str(status)]
    env = {key: value for key, value in ENV.items() if key != "DFLASH_VLLM_PYTHON"}
    done = subprocess.run(cli(target, prompts, out, "--max-new-tokens", "2", *extra), cwd=REPO,
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    first = json.loads(done.stdout.splitlines()[0])
    assert first["event"] == "engine" and first["engine"] == "hf" and first["python"] is None
    assert ("no vLLM in" in first["why"]) == (given is None)
    assert json.loads(status.read_text())["stop_reason"] == "finished"
