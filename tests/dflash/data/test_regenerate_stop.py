"""A regeneration says how far it is (a progress line every N rows) and a stop (SIGTERM) keeps its rows,
says where it stopped and exits 0; the same command then finishes it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_ops.data.data_manifest import manifest_path
from dflash_ops.data.regenerate import GenerationSettings, regenerate
from tests.dflash.conftest import make_tiny_target
from tests.dflash.data.test_regenerate_thinking import QWEN3_LIKE, save_chat_tokenizer

REPO = Path(__file__).resolve().parents[3]


def chat_target(directory: Path) -> str:
    """A tiny target with a Qwen3-like chat template, at `directory`/target."""
    path = directory / "target"
    make_tiny_target(path)
    save_chat_tokenizer(path, QWEN3_LIKE)
    return str(path)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return chat_target(tmp_path_factory.mktemp("regenerate-stop"))


def write_prompts(path: Path, n: int) -> str:
    chats = [[{"role": "user", "content": f"w{i % 19 + 1} w2"}] for i in range(n)]
    path.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in chats))
    return str(path)


class StopAfter:
    """A stop requested once `checks` checks have passed (the replica checks before each batch)."""

    signal_name = "SIGTERM"

    def __init__(self, checks: int):
        self.left = checks

    @property
    def requested(self) -> bool:
        self.left -= 1
        return self.left < 0


def test_a_stopped_regeneration_keeps_its_rows_and_the_next_call_finishes(target, tmp_path, capsys):
    prompts, out = write_prompts(tmp_path / "prompts.jsonl", 10), tmp_path / "train.jsonl"
    summary = regenerate(target, prompts, str(out), GenerationSettings(3, batch_size=2), progress_every=2,
                         stop=StopAfter(2))
    assert summary["stopped"] and summary["rows"] == 4 and summary["of"] == 10
    progress = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(p["event"], p["rows"], p["of"]) for p in progress] == [("progress", 2, 10), ("progress", 4, 10)]
    assert not manifest_path(out).exists() and list(tmp_path.glob("train.jsonl.part-*")), "nothing merged"
    summary = regenerate(target, prompts, str(out), GenerationSettings(3, batch_size=2))
    assert summary["generated"] == 6 and summary["rows"] == 10 and "stopped" not in summary
    assert json.loads(manifest_path(out).read_text())["rows"] == 10


def test_sigterm_says_where_it_stopped_and_exits_0(target, tmp_path):
    prompts, out = write_prompts(tmp_path / "prompts.jsonl", 400), tmp_path / "train.jsonl"
    command = [sys.executable, "-m", "dflash_ops.data", "regenerate", "--target", target,
               "--prompts", prompts, "--out", str(out), "--max-new-tokens", "3", "--batch-size", "1",
               "--progress-every", "1"]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert json.loads(process.stdout.readline())["event"] == "engine"
    first = json.loads(process.stdout.readline())
    assert first["event"] == "progress"
    process.send_signal(signal.SIGTERM)
    rest, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    stopped = json.loads(rest.splitlines()[-1])
    assert stopped["event"] == "stopped" and stopped["signal"] == "SIGTERM" and 1 <= stopped["rows"] < 400
    assert f"{stopped['rows']} of 400 prompts have their row" in err and "run the same command again" in err
