"""The feature cache: what the capture writes (shards, checksums, manifest), its resume by shard,
its disk-space check, and the clear errors a run gets for a cache it cannot train from."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash_ops.capture import main as capture_main
from dflash_ops.config import main as config_main
from dflash_ops.core.config import ConfigError, config_from_dict
from dflash_ops.core.runtime import StopSignal
from dflash_ops.data import capture as capture_module
from dflash_ops.data.capture import FREE_BYTES_ENV, CaptureError, capture, capture_batches
from dflash_ops.data.examples import collate, load_examples
from dflash_ops.data.feature_cache import MANIFEST, PLAN, check_cache
from dflash_ops.data.target import load_target, target_document_states
from dflash_ops.run.main import run_single_process
from tests.dflash.conftest import make_tiny_target

REPO = Path(__file__).resolve().parents[3]
SMALL_SHARDS = 20_000  # bytes: about one batch of the tiny data set per shard


class StopAfter(StopSignal):
    """A stop requested once `n` shards are written (as SIGTERM during the n-th would)."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def shard_written(self) -> None:
        self.n -= 1
        if self.n == 0:
            self.event.set()
            self.signal_name = "SIGTERM"


class Log:
    """An EventLog stand-in that keeps the events (and tells a StopAfter of each shard)."""

    def __init__(self, stop: StopAfter | None = None):
        self.events: list[dict] = []
        self.stop = stop

    def emit(self, event: str, **fields) -> None:
        self.events.append({"event": event, **fields})
        if event == "shard" and self.stop is not None:
            self.stop.shard_written()


def packed_ids(examples, batch: list[int]) -> torch.Tensor:
    return torch.cat([examples[i].input_ids for i in batch])


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def cached(tiny_config, tmp_path):
    """Factory: `cached(**sections)` -> (config, cache dir) of a finished capture of the tiny data set."""

    def make(**sections):
        out = tmp_path / "cache"
        raw = tiny_config(tmp_path / "run", **sections)
        capture(config_from_dict(raw), out, shard_bytes=SMALL_SHARDS, log=Log())
        raw["data"]["features_path"] = str(out)
        return config_from_dict(raw), out

    return make


def test_the_capture_writes_the_targets_features_of_each_batch_with_checksums(cached, tiny_target,
                                                                              tiny_dataset):
    cfg, out = cached()
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["layer_ids"] == [2] and manifest["dtype"] == "float32" and manifest["width"] == 32
    assert manifest["dataset"]["examples"] == 32 and manifest["order"] == {"batch_size": 4, "seed": 0}
    assert len(manifest["shards"]) > 2
    target = load_target(tiny_target)
    examples = load_examples(tiny_dataset, cfg.data.max_length)
    batches = capture_batches(len(examples), 4, 0)
    seen = []
    for shard in manifest["shards"]:
        path = out / shard["name"]
        assert sha256(path) == shard["sha256"] and path.stat().st_size == shard["bytes"]
        tensors = load_file(path)  # a plain safetensors file
        first, end = shard["batches"]
        assert tensors["example_ids"].tolist() == [i for b in batches[first:end] for i in b]
        seen += tensors["example_ids"].tolist()
        rows = 0
        for batch in batches[first:end]:
            padded = collate([examples[i] for i in batch])
            packed = target_document_states(target, packed_ids(examples, batch),
                                            [examples[i].input_ids.numel() for i in batch], [2])
            n = packed.features.shape[0]
            assert torch.equal(tensors["features"][rows: rows + n], packed.features)  # no padding computed
            assert torch.equal(tensors["input_ids"][rows: rows + n].long(), packed.pack(padded["input_ids"]))
            assert torch.equal(tensors["loss_mask"][rows: rows + n].long(), packed.pack(padded["loss_mask"]))
            assert torch.equal(tensors["position_ids"][rows: rows + n].long(), packed.position_ids)
            rows += n
        assert rows == shard["tokens"] == tensors["cu_seqlens"][-1]
    assert sorted(seen) == list(range(32))
    assert not list(out.glob("shard-*.json")) and not list(out.glob(".*"))
    assert check_cache(cfg) == manifest


def test_a_stopped_capture_resumes_by_shard_and_writes_what_one_run_writes(tiny_config, tmp_path):
    cfg = config_from_dict(tiny_config(tmp_path / "run"))
    whole = tmp_path / "whole"
    capture(cfg, whole, shard_bytes=SMALL_SHARDS, log=Log())
    expected = json.loads((whole / MANIFEST).read_text())["shards"]

    out = tmp_path / "stopped"
    stop = StopAfter(2)
    log = Log(stop)
    assert capture(cfg, out, shard_bytes=SMALL_SHARDS, log=log, stop=stop)["event"] == "stopped"
    assert [e["event"] for e in log.events] == ["capture_start", "shard", "shard", "stopped"]
    start = log.events[0]  # what the whole cache costs, said before anything is written
    assert start["total_bytes"] == sum(s["bytes"] for s in expected)
    assert start["bytes_per_token"] > 32 * 4  # the tiny target's one layer: 32 float32 features a token
    assert not (out / MANIFEST).exists() and (out / PLAN).is_file()
    unfinished = config_from_dict(tiny_config(tmp_path / "run", data={"features_path": str(out)}))
    with pytest.raises(ConfigError, match="not finished .2 shard file.s. written.: run python -m dflash_ops"):
        check_cache(unfinished)
    # A kill half-way through the third shard leaves its temp file; a shard without its record is redone.
    (out / f".{expected[2]['name']}.tmp").write_bytes(b"partial")
    (out / expected[3]["name"]).write_bytes(b"written, never recorded")
    log = Log()
    assert capture(cfg, out, shard_bytes=SMALL_SHARDS, log=log)["event"] == "captured"
    assert [e["shard"] for e in log.events if e["event"] == "shard"] == [s["name"] for s in expected[2:]]
    assert json.loads((out / MANIFEST).read_text())["shards"] == expected
    assert all(sha256(out / s["name"]) == s["sha256"] for s in expected)
    again = Log()
    assert capture(cfg, out, shard_bytes=SMALL_SHARDS, log=again)["shards_written"] == 0


def test_a_capture_refuses_another_plan_and_a_directory_that_is_not_its_own(tiny_config, tmp_path):
    cfg = config_from_dict(tiny_config(tmp_path / "run"))
    out = tmp_path / "cache"
    capture(cfg, out, shard_bytes=SMALL_SHARDS, log=Log())
    other = config_from_dict(tiny_config(tmp_path / "run", model={"target_layer_ids": [1, 3]}))
    with pytest.raises(CaptureError, match="another plan .it differs in layer_ids, shards, width."):
        capture(other, out, shard_bytes=SMALL_SHARDS, log=Log())
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(CaptureError, match="is not empty and holds no capture"):
        capture(cfg, busy, log=Log())


def test_a_capture_that_does_not_fit_is_refused_with_the_estimate_and_the_free_space(tiny_config, tmp_path):
    cfg = config_from_dict(tiny_config(tmp_path / "run"))
    out = tmp_path / "cache"
    with pytest.raises(CaptureError) as refused:
        capture(cfg, out, shard_bytes=SMALL_SHARDS, free=100_000, log=Log())
    whole = tmp_path / "whole"
    capture(cfg, whole, shard_bytes=SMALL_SHARDS, log=Log())
    needed = sum(p.stat().st_size for p in whole.glob("shard-*"))
    assert f"needs an estimated 0.00 GiB ({needed} bytes" in str(refused.value)  # the estimate is exact
    assert "has 0.00 GiB free (100000 bytes)" in str(refused.value)
    assert not out.exists(), "nothing is written"
    # Through the entry point, with the test knob standing in for a full disk: exit 2, no traceback.
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps(tiny_config(tmp_path / "run", data={"features_path": str(out)})))
    os.environ[FREE_BYTES_ENV] = "1000"
    try:
        assert capture_main(["--config", str(config)]) == 2
    finally:
        del os.environ[FREE_BYTES_ENV]
    assert not out.exists()
    assert capture_main(["--config", str(config), "--shard-mb", "1"]) == 0
    assert (out / MANIFEST).is_file()


def corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


BAD_CACHES = {
    "missing manifest": (lambda out: (out / MANIFEST).unlink(), {},
                         "data.features_path: no manifest.json in .*: the capture there has not finished"),
    "corrupt shard": (lambda out: corrupt(out / "shard-00001.safetensors"),
                      {"data": {"features_verify": "checksums"}},
                      r"shard-00001.safetensors is corrupt: its sha256 is .*remove it and run python -m "
                      "dflash_ops.capture"),
    "truncated shard": (lambda out: os.truncate(out / "shard-00002.safetensors", 100), {},
                        "shard-00002.safetensors is truncated or damaged: 100 bytes, the manifest says"),
    "other layer ids": (None, {"model": {"target_layer_ids": [1]}},
                        r"model.target_layer_ids: .* holds features of target layers \[2\], "
                        r"this run's is \[1\]"),
    "other dtype": (None, {"model": {"dtype": "bfloat16"}},
                    "model.dtype: .* holds features of dtype float32"),
    "other max_length": (None, {"data": {"max_length": 40}},
                         "data.max_length: .* holds features of the max_length 48"),
}


@pytest.mark.parametrize("case", sorted(BAD_CACHES))
def test_a_cache_the_run_cannot_train_from_is_refused_before_training(case, cached, capsys):
    damage, sections, message = BAD_CACHES[case]
    cfg, out = cached()
    if damage is not None:
        damage(out)
    raw = cfg.to_dict()
    for section, values in sections.items():
        raw[section].update(values)
    code = run_single_process(config_from_dict(raw))
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert __import__("re").search(message, err), err
    assert not (Path(cfg.run.output_dir) / "checkpoints").exists(), "refused before any step"
    assert json.loads((Path(cfg.run.output_dir) / "status.json").read_text())["state"] == "failed"


def test_a_cache_of_another_target_or_data_set_is_refused(cached, tiny_config, tiny_dataset, tmp_path):
    cfg, out = cached()
    # Same architecture and config, other weights: the weights' fingerprint tells them apart.
    other = make_tiny_target(tmp_path / "other-target", seed=1)
    raw = cfg.to_dict()
    raw["model"]["target_path"] = str(other)
    with pytest.raises(ConfigError, match="of another target .*weights_fingerprint") as refused:
        check_cache(config_from_dict(raw))
    assert refused.value.key == "data.features_path"
    assert "python -m dflash_ops.capture" in refused.value.message
    data = tmp_path / "other.jsonl"
    data.write_text(tiny_dataset.read_text().replace("[0,", "[1,", 1) + "\n")
    raw = cfg.to_dict()
    raw["data"]["path"] = str(data)
    with pytest.raises(ConfigError, match="holds features of another data set"):
        check_cache(config_from_dict(raw))
    raw["data"]["features_path"] = str(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="no feature cache at .*nowhere"):
        check_cache(config_from_dict(raw))


def test_the_layout_and_the_cache_keys_are_checked(tiny_config, tmp_path):
    drafters_only = {"device": "cpu", "drafter_workers": 2, "target_workers": 0}
    with pytest.raises(ConfigError, match="target_workers: names no target: the features need one, or data"):
        config_from_dict(tiny_config(tmp_path, pipeline=drafters_only))
    with pytest.raises(ConfigError, match="pipeline.target_workers: must name no target with data.features"):
        config_from_dict(tiny_config(tmp_path, data={"features_path": "/srv/features"},
                                     pipeline={**drafters_only, "target_workers": 1}))
    with pytest.raises(ConfigError, match="data.features_verify: must be one of checksums, sizes"):
        config_from_dict(tiny_config(tmp_path, data={"features_verify": "none"}))
    cached = {"features_path": "/srv/features"}
    cfg = config_from_dict(tiny_config(tmp_path, data=cached, pipeline=drafters_only))
    assert cfg.pipeline.local_counts == (2, 0)


@pytest.mark.slow
def test_two_replicas_write_the_shards_one_writes(tiny_config, tmp_path):
    cfg = config_from_dict(tiny_config(tmp_path / "run"))
    capture(cfg, tmp_path / "one", shard_bytes=SMALL_SHARDS, log=Log())
    log = Log()
    capture(cfg, tmp_path / "two", replicas=2, shard_bytes=SMALL_SHARDS, log=log)
    assert {e["replica"] for e in log.events if e["event"] == "shard"} == {0, 1}
    one, two = ((tmp_path / name / MANIFEST).read_text() for name in ("one", "two"))
    assert json.loads(one)["shards"] == json.loads(two)["shards"]


def test_validate_refuses_a_corrupt_cache_before_a_deploy_stops_anything(cached, tmp_path, capsys):
    cfg, out = cached()
    config = tmp_path / "config.yaml"
    checksums = {**cfg.to_dict(), "data": {**cfg.to_dict()["data"], "features_verify": "checksums"}}
    config.write_text(json.dumps(checksums))
    assert config_main(["validate", "--json", str(config)]) == 0
    capsys.readouterr()
    corrupt(out / "shard-00000.safetensors")
    # As a deploy runs it: its own process, where dflash_ops.config is __main__.
    validate = subprocess.run([sys.executable, "-m", "dflash_ops.config", "validate", "--json", str(config)],
                              cwd=REPO, capture_output=True, text=True, timeout=120)
    assert validate.returncode == 2 and "Traceback" not in validate.stderr, validate.stderr
    verdict = json.loads(validate.stdout)
    assert verdict["key"] == "data.features_path"
    assert "shard-00000.safetensors is corrupt" in verdict["message"]
    assert cfg.data.features_verify == "sizes"  # the default: the damage goes unseen, as documented
    config.write_text(json.dumps(cfg.to_dict()))
    assert config_main(["validate", str(config)]) == 0


def test_a_write_that_fails_fails_the_shard_and_the_next_capture_redoes_it(tiny_config, tmp_path,
                                                                           monkeypatch):
    cfg = config_from_dict(tiny_config(tmp_path / "run"))
    out = tmp_path / "cache"
    real_write = capture_module.BackgroundWriter._write

    def no_space(data):
        raise OSError(28, "No space left on device")

    def disk_full(self):
        self.f.write = no_space
        real_write(self)

    monkeypatch.setattr(capture_module.BackgroundWriter, "_write", disk_full)
    with pytest.raises(OSError, match="No space left on device"):
        capture(cfg, out, shard_bytes=SMALL_SHARDS, log=Log())
    monkeypatch.undo()
    assert list(out.glob(".shard-00000.safetensors.tmp")) and not list(out.glob("shard-*"))
    assert capture(cfg, out, shard_bytes=SMALL_SHARDS, log=Log())["event"] == "captured"
    assert not list(out.glob(".*.tmp"))
