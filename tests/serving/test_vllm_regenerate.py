"""Regeneration on vLLM (its CPU build, the venv of `make serve-check`): `python -m dflash_ops.data regenerate
--engine vllm` on the tiny demo target, beside the transformers path on the same prompts.

- Faithful: in float32, greedy, vLLM's rows equal the transformers path's token for token on at least 90 % of
  the prompts (the rate is printed: where they differ, it is the first near-tie of two logits that the two
  kernels' sums break differently).
- Faults: the engine's process killed mid-job (SIGKILL, as an out-of-memory kill does) ends the call with
  exit 2 and the engine's exit, no process of the engine's group left (vLLM's own engine core and workers),
  the rows written kept; the same command then finishes, rows equal to an uninterrupted run's.
Marked `serve` (two engine starts of a minute or more each): `make regenerate-check`, and `make serve-check`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.serve import KV_CACHE_GIB, SERVE_PYTHON, serve_venv_problem
from dflash_ops.data.regenerate import read_rows

pytestmark = pytest.mark.serve
REPO = Path(__file__).resolve().parents[2]
PROMPTS = 32
MAX_NEW_TOKENS = 24
ENV = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB, "OMP_NUM_THREADS": "2"}


def command(target: Path, prompts: Path, out: Path, engine: str, *extra: str) -> list[str]:
    python = ["--engine-python", str(SERVE_PYTHON)] if engine == "vllm" else []  # hf: in this process
    return [sys.executable, "-m", "dflash_ops.data", "regenerate", "--target", str(target),
            "--prompts", str(prompts), "--out", str(out), "--engine", engine, *python, "--dtype", "float32",
            "--max-length", "512", "--max-new-tokens", str(MAX_NEW_TOKENS), *extra]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    problem = serve_venv_problem()
    if problem:
        pytest.skip(problem)
    from pvesim.fleet import prepare_assets

    workdir = tmp_path_factory.mktemp("vllm-regenerate")
    words = ["cats", "rivers", "stars", "rain", "trees", "boats", "clouds", "songs"]
    chats = [[{"role": "user", "content": f"tell me about {words[i % 8]} and {words[(i * 3 + 1) % 8]} {i}"}]
             for i in range(PROMPTS)]
    prompts = workdir / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in chats))
    target = prepare_assets() / "target"
    rows = {}
    for engine in ("hf", "vllm"):
        out = workdir / f"{engine}.jsonl"
        done = subprocess.run(command(target, prompts, out, engine), cwd=REPO, capture_output=True, text=True,
                              env=ENV, timeout=1200)
        assert done.returncode == 0, done.stderr[-4000:]
        rows[engine] = read_rows(out)
    return {"target": target, "prompts": prompts, "workdir": workdir, **rows}


def test_vllms_greedy_rows_are_the_transformers_paths_on_90_percent_of_prompts(demo):
    hf, vllm = demo["hf"], demo["vllm"]
    assert sorted(hf) == sorted(vllm) == list(range(PROMPTS))
    same = sum(hf[i] == vllm[i] for i in hf)
    print(f"vLLM rows equal to transformers': {same} of {PROMPTS} ({same / PROMPTS:.0%})")
    assert same >= 0.9 * PROMPTS
    for i in hf:  # the prompt part is the same chat template either way; the answers end within the bound
        assert hf[i]["loss_mask"].index(1) == vllm[i]["loss_mask"].index(1)
        assert sum(vllm[i]["loss_mask"]) <= MAX_NEW_TOKENS


def descendants(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children")
    found = [int(child) for child in children.read_text().split()] if children.exists() else []
    return found + [grandchild for child in found for grandchild in descendants(child)]


def test_a_killed_engine_worker_ends_the_call_and_the_next_call_finishes_it(demo):
    out = demo["workdir"] / "killed.jsonl"
    argv = command(demo["target"], demo["prompts"], out, "vllm", "--progress-every", "1")
    process = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=ENV)
    for line in process.stdout:
        if json.loads(line)["event"] == "progress":
            break
    # The engine process this call started (its first child; vLLM's engine core and workers are below it).
    engine = descendants(process.pid)[0]
    assert len(descendants(engine)) >= 1  # vLLM runs its engine core in processes of its own
    os.kill(engine, signal.SIGKILL)
    _, err = process.communicate(timeout=600)
    assert process.returncode == 2, err[-4000:]
    assert "the engine of replica 0 ended (killed by SIGKILL)" in err and "run the same command again" in err
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the engine's group ends with it
        try:
            os.killpg(engine, 0)
        except ProcessLookupError:
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"processes of the engine's group {engine} outlived the call")
    kept = read_rows(out.with_name("killed.jsonl.part-0"))
    assert 1 <= len(kept) < PROMPTS
    again = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, env=ENV, timeout=1200)
    assert again.returncode == 0, again.stderr[-4000:]
    assert json.loads(again.stdout.splitlines()[-1])["skipped_done"] == len(kept)
    assert read_rows(out) == demo["vllm"]
