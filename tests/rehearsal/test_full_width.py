"""The first real run's layout, rehearsed on CPU at Qwen3-8B's width (`make rehearsal`; marker
`rehearsal`, never in make test): a target of Qwen3-8B's hidden size, heads, MLP and vocabulary (2
layers, random bf16 weights), 1 target worker and 2 drafter workers of 1 full-width layer each, the
held-out set on, through the product's path (`python -m dflash_ops.train`: the launcher, torchrun, the
pipeline). It starts, steps, evaluates, checkpoints on SIGTERM, resumes at the saved step + 1 and is
exported; each rank's peak resident memory (VmHWM, written at its exit by a `sitecustomize` on the
workers' path) must be within 15 % of `dflash_ops.training.memory_fit`'s prediction for the same config,
the CPU process's runtime baseline measured here and named as the `runtime` term.

The embedding and lm_head are tied (one 1.2 GiB tensor instead of two) to keep the three ranks under
~15 GiB on a 24 GiB machine shared with other work; the memory model counts a tied head once."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from dflash_ops.core.config import load_config
from dflash_ops.training import memory_fit
from dflash_ops.training.checkpoint import latest_checkpoint
from pvesim.fleet import prepare_assets
from tests.pipeline.conftest import TrainProcess

pytestmark = pytest.mark.rehearsal
REPO = Path(__file__).resolve().parents[2]
QWEN3_8B_WIDTH = dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=151936)
TOLERANCE = 0.15
STEPS = 4
RECORDER = '''
import atexit, json, os


def _record():
    if os.environ.get("RANK") is None:
        return  # the launcher and torchrun's agent
    status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
    with open(os.environ["DFLASH_REHEARSAL_PEAKS"], "a") as out:
        out.write(json.dumps({"rank": os.environ["RANK"], "pid": os.getpid(),
                              "hwm": int(status["VmHWM"].split()[0]) * 1024}) + "\\n")


atexit.register(_record)
# A pipeline worker leaves with os._exit once its checkpoint is written (dflash_ops/run/pipeline.py), which
# runs no atexit hook: record on that path as well.
_exit = os._exit


def _record_and_exit(code):
    _record()
    _exit(code)


os._exit = _record_and_exit
'''
# What a worker process holds before any model: the interpreter and the trainer's imports.
BASELINE = '''
import resource
import dflash_ops.run.main, dflash_ops.run.pipeline  # noqa
import dflash_ops.training.drafter_run, dflash_ops.data.target  # noqa
from transformers import Qwen3ForCausalLM  # noqa
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
print(int(status["VmHWM"].split()[0]) * 1024)
'''


def write_target(out: Path, demo_target: Path) -> None:
    """Qwen3-8B's width with 2 layers, random bf16 weights, the demo's tokenizer (its ids are a prefix of
    the vocabulary, as Qwen3's tokenizer's 151669 are of its 151936 rows)."""
    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out.mkdir(parents=True)
    config = Qwen3Config(num_hidden_layers=2, tie_word_embeddings=True, max_position_embeddings=4096,
                         dtype="bfloat16", **QWEN3_8B_WIDTH)
    with torch.device("meta"):
        state = Qwen3ForCausalLM(config).state_dict()
    shapes = {n: p.shape for n, p in state.items() if n != "lm_head.weight"}  # tied: the embedding's
    generator = torch.Generator().manual_seed(0)
    weights = {n: (torch.ones(s) if n.endswith("norm.weight") else torch.randn(s, generator=generator) * 0.02)
               .to(torch.bfloat16) for n, s in shapes.items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    del weights
    config.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (out / name).write_bytes((demo_target / name).read_bytes())


def cut_rows(source: Path, dest: Path, keep: int, count: int) -> Path:
    """The first `count` rows of `source`, each cut to its first `keep` tokens."""
    rows = [json.loads(line) for line in source.read_text().splitlines()[:count]]
    dest.write_text("".join(json.dumps({k: v[:keep] for k, v in r.items()}) + "\n" for r in rows))
    return dest


def runtime_baseline() -> int:
    done = subprocess.run([sys.executable, "-c", BASELINE], cwd=REPO, capture_output=True, text=True,
                          check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return int(done.stdout.strip())


def peaks_by_worker(run: TrainProcess, peaks: Path) -> dict[str, int]:
    roles = {str(e["rank"]): e["worker"] for e in run.events() if e["event"] == "worker_start"}
    found = {}
    for line in peaks.read_text().splitlines():
        record = json.loads(line)
        found[roles[record["rank"]]] = record["hwm"]
    return found


def test_the_pipeline_at_qwen3_8b_width_starts_evaluates_stops_resumes_exports_within_its_memory_model(
        tmp_path):
    started = time.monotonic()
    demo_dir = prepare_assets()
    target = tmp_path / "target"
    write_target(target, demo_dir / "target")
    # On a CPU without bf16 instructions torch's bf16 products in the backward's layout run at ~0.1 GMAC/s:
    # the lm_head's backward costs ~6 s of a core per drafted row at this width. So the drafted rows are
    # few (block 2, one anchor a document, documents of 24 prompt + 4 response tokens), the run short.
    data = cut_rows(demo_dir / "data" / "train.jsonl", tmp_path / "train.jsonl", 28, 64)
    heldout = cut_rows(demo_dir / "data" / "eval.jsonl", tmp_path / "eval.jsonl", 27, 1)
    raw = {
        "model": {"target_path": str(target), "num_draft_layers": 1, "block_size": 2, "dtype": "bfloat16",
                  "loss_chunk_size": 512},
        "data": {"path": str(data), "max_length": 256, "batch_size": 1, "max_anchors": 1,
                 "eval_path": str(heldout), "eval_examples": 1},
        "optim": {"total_steps": STEPS, "warmup_ratio": 0.0},
        "run": {"output_dir": str(tmp_path / "run"), "save_every": 1000, "eval_every": 2, "log_every": 1},
        "pipeline": {"device": "cpu", "target_workers": 1, "drafter_workers": 2, "threads_per_worker": 1,
                     "queue_depth": 2},
    }
    config = tmp_path / "rehearsal.yaml"
    config.write_text(yaml.safe_dump(raw))
    written = time.monotonic()
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(RECORDER)

    def start(name: str) -> tuple[TrainProcess, Path]:
        peaks = tmp_path / f"{name}-peaks.jsonl"
        env = {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
               "DFLASH_REHEARSAL_PEAKS": str(peaks)}
        return TrainProcess(config, tmp_path / f"{name}.log", env), peaks

    first, first_peaks = start("first")
    try:
        # SIGTERM once the held-out evaluation of step 2 is logged, during the steps after it.
        first.wait_for(lambda s: s["step"] >= 2 and s["state"] == "running"
                       and any(e["event"] == "heldout" for e in first.events()), timeout=2400)
        os.killpg(first.pgid, signal.SIGTERM)
        assert first.wait(timeout=600) == 0, first.log_path.read_text()[-3000:]
    finally:
        first.kill()
    stopped = time.monotonic()
    events = first.events()
    saved = first.status()["step"]
    assert 2 <= saved < STEPS, saved
    assert latest_checkpoint(first.output_dir).name == f"step-{saved:08d}"
    assert [e["step"] for e in events if e["event"] == "heldout"][:1] == [2]

    resumed, resumed_peaks = start("resumed")
    try:
        assert resumed.wait(timeout=2400) == 0, resumed.log_path.read_text()[-3000:]
    finally:
        resumed.kill()
    again = resumed.events()
    assert [e["step"] for e in again if e["event"] == "resume"] == [saved]
    assert [e["step"] for e in again if e["event"] == "step"][0] == saved + 1
    assert resumed.status()["step"] == STEPS
    finished = time.monotonic()

    export = tmp_path / "export"
    subprocess.run([sys.executable, "-m", "dflash_ops.export", "--checkpoint", str(first.output_dir), "--out",
                    str(export)], cwd=REPO, check=True, capture_output=True, text=True, timeout=600)
    assert json.loads((export / "config.json").read_text())["hidden_size"] == 4096
    exported = time.monotonic()

    runtime = runtime_baseline()
    cfg = load_config(config)
    predicted = {p.role: p for p in memory_fit.predict(cfg, runtime_bytes=runtime)}
    rows = []
    for name, run, peaks in (("first", first, first_peaks), ("resumed", resumed, resumed_peaks)):
        for worker, hwm in sorted(peaks_by_worker(run, peaks).items()):
            peak = predicted["target" if worker.startswith("target") else "drafter"]
            rows.append((name, worker, hwm, peak.total))
    # The recipe's depth from the same terms: what a drafter rank of this run would hold with 5 layers.
    recipe_depth = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_draft_layers=5))
    five_layers = memory_fit.predict(recipe_depth, runtime_bytes=runtime)[-1]
    report = {"runtime_gib": runtime / memory_fit.GiB,
              "drafter_at_5_layers_gib": five_layers.total / memory_fit.GiB,
              "seconds": {"assets": written - started, "first_run": stopped - written,
                          "resumed_run": finished - stopped, "export": exported - finished},
              "rows": [{"run": n, "worker": w, "measured_gib": m / memory_fit.GiB,
                        "predicted_gib": p / memory_fit.GiB, "ratio": p / m} for n, w, m, p in rows],
              "terms": {role: {t: b / memory_fit.GiB for t, b in peak.terms}
                        for role, peak in predicted.items()}}
    print(json.dumps(report, indent=1))
    (Path(os.environ.get("DFLASH_REHEARSAL_REPORT", tmp_path / "report.json"))).write_text(json.dumps(report))
    assert sorted(w for n, w, _, _ in rows if n == "first") == ["drafter0", "drafter1", "target0"]
    for name, worker, measured, want in rows:
        assert abs(want - measured) <= TOLERANCE * measured, (name, worker, measured, want, report)
