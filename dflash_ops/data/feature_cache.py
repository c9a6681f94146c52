"""The offline feature cache: the target's packed features of a data set, captured once
(`python -m dflash_ops.capture`) and read by any number of drafter runs (`data.features_path`).

A cache directory holds:

- `capture.json`, the plan, written when a capture starts: the target (a hash of its config.json,
  a fingerprint of its weights), the layer ids, dtype and width of the features, the data set (its
  file's sha256, examples, max_length, tokens), the batches the target ran on (the epoch-0 order of
  `BatchOrder` for the config's batch_size and seed, so that the first epoch of a run with that
  order sees the features the online target computes for it, bit for bit) and the shards (which
  batches each holds, its documents, tokens and bytes). A capture started again continues only
  when its plan is the same.
- `shard-NNNNN.safetensors`, the documents of consecutive batches: `cu_seqlens` [N+1] int64
  (document bounds in the shard), `example_ids` [N] int64 (each document's example index in the
  data set), `input_ids` [T] int32, `position_ids` [T] int32, `features` [T, k*H] in the model
  dtype, `loss_mask` [T] uint8, in that order (every tensor aligned for its dtype). Written to a
  hidden temp file, fsynced and renamed into place; `shard-NNNNN.json` beside it records its
  sha256 and size (written after it, so a shard without one is written again).
- `manifest.json`, written last, when every shard is there: the plan with each shard's sha256.
  A directory without it holds an unfinished capture.

This module reads no tensors and imports no torch, so that the launcher and `python -m
dflash_ops.config validate` can check a cache; the reader is `dflash_ops.run.cache_feed`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dflash_ops.core.config import ConfigError, TrainConfig, target_shape
from dflash_ops.core.loss_section import capture_layer_ids, needs_target
from dflash_ops.core.target_layers import build_target_layer_ids

FORMAT = "dflash-features/1"
MANIFEST, PLAN = "manifest.json", "capture.json"
# A cache of some rows holds them here, the data.path of a run that reads it (dflash_ops.data.subset).
SUBSET_FILE = "data.jsonl"
KEY = "data.features_path"
FEATURE_DTYPES = {"float32": "F32", "bfloat16": "BF16"}
ELEMENT_BYTES = {"F32": 4, "BF16": 2, "I64": 8, "I32": 4, "U8": 1}
# Bytes a shard spends per token and per document besides the features.
TOKEN_METADATA_BYTES = 4 + 4 + 1  # input_ids, position_ids, loss_mask
DOCUMENT_METADATA_BYTES = 8 + 8  # cu_seqlens, example_ids
# config.json keys that say how the file was written, not what the model is.
VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path")
FINGERPRINT_SAMPLES, FINGERPRINT_SAMPLE_BYTES = 64, 64 * 1024
HASH_CHUNK_BYTES = 8 << 20
FIX = "capture them again (python -m dflash_ops.capture --config <this config>) or name the right cache"


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def record_name(shard: str) -> str:
    """The JSON record beside a finished shard."""
    return shard.removesuffix(".safetensors") + ".json"


# --- identities ----------------------------------------------------------------------------------
def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def weight_files(target_path: Path) -> list[Path]:
    """The target's safetensors files: the shards its index names, or model.safetensors."""
    index = target_path / "model.safetensors.index.json"
    if index.is_file():
        names = set(json.loads(index.read_text())["weight_map"].values())
        return [target_path / name for name in sorted(names)]
    return [target_path / "model.safetensors"]


def weights_fingerprint(target_path: Path) -> str:
    """A sha256 over each weight file's name, size, safetensors header and 64 KiB at 64 evenly
    spaced offsets: any retrained or other model changes it, and it reads ~4 MiB per file
    (a full hash would read the whole target at every start of a run)."""
    digest = hashlib.sha256()
    for path in weight_files(target_path):
        if not path.is_file():
            raise ConfigError("model.target_path", f"no weights at {path}")
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}:".encode())
        with path.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            digest.update(f.read(min(header_len, size)))
            step = max(1, (size - FINGERPRINT_SAMPLE_BYTES) // FINGERPRINT_SAMPLES)
            for offset in range(0, max(1, size - FINGERPRINT_SAMPLE_BYTES), step)[:FINGERPRINT_SAMPLES]:
                f.seek(offset)
                digest.update(f.read(FINGERPRINT_SAMPLE_BYTES))
    return digest.hexdigest()


def target_identity(target_path: str | Path) -> dict:
    """What names a target: its config (less the keys that only say how it was saved) and its
    weights' fingerprint."""
    path = Path(target_path)
    config = json.loads((path / "config.json").read_text())
    canonical = json.dumps({k: v for k, v in config.items() if k not in VOLATILE_CONFIG_KEYS}, sort_keys=True)
    return {"path": str(path), "config_sha256": hashlib.sha256(canonical.encode()).hexdigest(),
            "weights_fingerprint": weights_fingerprint(path)}


def resolved_layer_ids(cfg: TrainConfig) -> list[int]:
    """The layer ids the cache holds: those the run trains on (the configured ones, else the default for
    its target), then the target's last layer when loss.kind needs the target's distribution
    (`dflash_ops.core.loss_section.capture_layer_ids`: its last hidden state, one more H-wide column)."""
    if cfg.model.target_layer_ids and not needs_target(cfg.loss.mix):
        return list(cfg.model.target_layer_ids)
    n_layers = target_shape(cfg.model.target_path)[0]
    ids = list(cfg.model.target_layer_ids or build_target_layer_ids(n_layers, cfg.model.num_draft_layers))
    return capture_layer_ids(ids, n_layers, cfg.loss.mix)


# --- shard files ---------------------------------------------------------------------------------
def shard_header(n_tokens: int, n_docs: int, width: int,
                 dtype: str) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The safetensors header of a shard (its 8-byte length, then the JSON padded to 8 bytes) and
    each tensor's [begin, end) byte range in the file."""
    tensors = {
        "cu_seqlens": ("I64", [n_docs + 1]), "example_ids": ("I64", [n_docs]),
        "input_ids": ("I32", [n_tokens]), "position_ids": ("I32", [n_tokens]),
        "features": (FEATURE_DTYPES[dtype], [n_tokens, width]), "loss_mask": ("U8", [n_tokens]),
    }
    header: dict = {"__metadata__": {"format": FORMAT}}
    offset = 0
    for name, (code, shape) in tensors.items():
        size = math.prod(shape) * ELEMENT_BYTES[code]
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    prefix = struct.pack("<Q", len(text)) + text
    start = len(prefix)
    ranges = {name: (start + entry["data_offsets"][0], start + entry["data_offsets"][1])
              for name, entry in header.items() if name != "__metadata__"}
    return prefix, ranges


def shard_bytes(n_tokens: int, n_docs: int, width: int, dtype: str) -> int:
    prefix, ranges = shard_header(n_tokens, n_docs, width, dtype)
    return max(end for _, end in ranges.values())


def read_shard_header(path: Path) -> dict[str, tuple[str, list[int], int, int]]:
    """name -> (safetensors dtype, shape, begin, end) of a shard, byte ranges within the file."""
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError("shorter than a safetensors header")
        (length,) = struct.unpack("<Q", raw)
        header = json.loads(f.read(length))
    start = 8 + length
    return {name: (e["dtype"], e["shape"], start + e["data_offsets"][0], start + e["data_offsets"][1])
            for name, e in header.items() if name != "__metadata__"}


def write_json(path: Path, record: dict) -> None:
    """Write `record` to `path` atomically (temp file, fsync, rename)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("w") as f:
        f.write(json.dumps(record, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# --- plans, space ----------------------------------------------------------------------------------
def plan_shards(batches: list[tuple[int, int]], width: int, dtype: str, target_bytes: int) -> list[dict]:
    """Consecutive batches per shard, each (documents, tokens), until a shard holds `target_bytes`."""
    shards: list[dict] = []
    first, docs, tokens = 0, 0, 0
    for i, (n_docs, n_tokens) in enumerate(batches):
        docs, tokens = docs + n_docs, tokens + n_tokens
        if shard_bytes(tokens, docs, width, dtype) >= target_bytes or i == len(batches) - 1:
            shards.append({"name": shard_name(len(shards)), "batches": [first, i + 1], "documents": docs,
                           "tokens": tokens, "bytes": shard_bytes(tokens, docs, width, dtype)})
            first, docs, tokens = i + 1, 0, 0
    return shards


def free_bytes(directory: Path) -> int:
    """Free bytes of the file system that `directory` (or its nearest existing parent) is on."""
    existing = directory.resolve()
    while not existing.exists():
        existing = existing.parent
    return shutil.disk_usage(existing).free


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


# --- reading and checking a cache ------------------------------------------------------------------
def read_manifest(root: Path) -> dict:
    if not root.is_dir():
        raise ConfigError(KEY, f"no feature cache at {str(root)!r} (not a directory); {FIX}")
    path = root / MANIFEST
    if not path.is_file():
        plan = root / PLAN
        written = sum(1 for _ in root.glob("shard-*.safetensors"))
        how = (f"the capture there has not finished ({written} shard file(s) written): run python -m "
               "dflash_ops.capture again to finish it") if plan.is_file() else FIX
        raise ConfigError(KEY, f"no {MANIFEST} in {root}: {how}")
    try:
        manifest = json.loads(path.read_text())
        ok = manifest.get("format") == FORMAT and all(
            k in manifest for k in ("target", "layer_ids", "dtype", "width", "dataset", "order", "shards"))
    except (ValueError, AttributeError):
        ok = False
    if not ok:
        raise ConfigError(KEY, f"{path} is not a {FORMAT} manifest; {FIX}")
    return manifest


def _compare(label: str, found, expected, key: str, root: Path) -> None:
    if found != expected:
        raise ConfigError(key, f"{root} holds features of {label} {found}, this run's is {expected}: {FIX}")


def check_identity(cfg: TrainConfig, manifest: dict, root: Path) -> None:
    """The cache was captured from this run's target, layers, dtype and data set."""
    target = target_identity(cfg.model.target_path)
    for part in ("config_sha256", "weights_fingerprint"):
        if manifest["target"].get(part) != target[part]:
            theirs = manifest["target"]
            raise ConfigError(KEY, f"{root} holds features of another target ({theirs.get('path')}, {part} "
                              f"{str(theirs.get(part))[:12]}...), not of model.target_path "
                              f"{cfg.model.target_path} ({target[part][:12]}...): {FIX}")
    ours = resolved_layer_ids(cfg)
    # Layers that differ only by the last one: the cache was captured under another loss.kind.
    key = "loss.kind" if manifest["layer_ids"][:-1] == ours or ours[:-1] == manifest["layer_ids"] else \
        "model.target_layer_ids"
    _compare("target layers", manifest["layer_ids"], ours, key, root)
    _compare("dtype", manifest["dtype"], cfg.model.dtype, "model.dtype", root)
    dataset = manifest["dataset"]
    _compare("the max_length", dataset["max_length"], cfg.data.max_length, "data.max_length", root)
    # Which examples the cache holds (a cache from before the option has none: every example).
    _compare("examples kept by min_loss_tokens", dataset.get("min_loss_tokens"), cfg.data.min_loss_tokens,
             "data.min_loss_tokens", root)
    digest = file_sha256(cfg.data.path)
    subset = dataset.get("subset")
    if dataset["sha256"] != digest and subset and subset.get("of_sha256") == digest:
        rows = f"rows {subset['rows'][0]}:{subset['rows'][1]}" if "rows" in subset \
            else f"{subset['fraction']} of the rows"
        raise ConfigError("data.path", f"{root} holds the features of {rows} of {cfg.data.path} "
                          f"({subset['kept']} of {subset['of_rows']}), which the capture wrote to "
                          f"{root / SUBSET_FILE}: set data.path to that file")
    if dataset["sha256"] != digest:
        raise ConfigError(KEY, f"{root} holds features of another data set ({dataset['path']}, sha256 "
                          f"{dataset['sha256'][:12]}...), not of data.path {cfg.data.path} "
                          f"({digest[:12]}...): {FIX}")


def check_shards(root: Path, manifest: dict, checksums: bool) -> None:
    """Every shard is there at its size (and, with `checksums`, its sha256: hashed on several
    threads, hashlib releasing the GIL)."""
    shards = manifest["shards"]
    for shard in shards:
        path = root / shard["name"]
        if not path.is_file():
            raise ConfigError(KEY, f"{path} is missing: run python -m dflash_ops.capture again to write it")
        size = path.stat().st_size
        if size != shard["bytes"]:
            raise ConfigError(KEY, f"{path} is truncated or damaged: {size} bytes, the manifest says "
                              f"{shard['bytes']}; remove it and run python -m dflash_ops.capture again to "
                              "rewrite it")
    if not checksums:
        return
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        digests = list(pool.map(file_sha256, [root / s["name"] for s in shards]))
    for shard, digest in zip(shards, digests, strict=True):
        if digest != shard["sha256"]:
            raise ConfigError(KEY, f"{root / shard['name']} is corrupt: its sha256 is {digest[:12]}..., the "
                              f"manifest says {shard['sha256'][:12]}...; remove it and run python -m "
                              "dflash_ops.capture again to rewrite it")


def check_cache(cfg: TrainConfig, checksums: bool = True) -> dict:
    """The manifest of the run's feature cache, or ConfigError saying what is wrong with it and how
    to fix it: no cache or no manifest, another target, other layers, another dtype or data set,
    a missing, truncated or (with `checksums`) corrupt shard."""
    root = Path(cfg.data.features_path)
    manifest = read_manifest(root)
    check_identity(cfg, manifest, root)
    check_shards(root, manifest, checksums)
    return manifest
