"""Training configuration: one typed dataclass per section, loaded from YAML.

`load_config(path)` maps the YAML onto `TrainConfig`; unknown keys and wrong types are errors that
name the key and the value. `python -m dflash.config validate <yaml>` exits 0 when the file is good
and 2 with the message otherwise (the deploy role runs it before switching releases).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from dflash.devices import visible_devices
from dflash.mask_token import mask_token_problem
from dflash.safe_paths import output_dir_problem

DTYPES = ("float32", "bfloat16")
# model.loss_chunk_size's default: at Qwen3-8B's vocabulary a chunk's logits and their gradient
# take ~0.6 GiB, and 512-row matmuls keep the lm_head's throughput.
DEFAULT_LOSS_CHUNK_SIZE = 512
DEVICES = ("cpu", "cuda")


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type or out of range: `key` names it (a dotted
    path such as `data.batch_size`, or a section), `message` says what is wrong with it."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(key: str, value, tp):
    """Return `value` as type `tp` (int accepted for float) or raise ConfigError naming `key`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        members = typing.get_args(tp)
        if value is None and type(None) in members:
            return None
        for member in members:
            if member is type(None):
                continue
            try:
                return _coerce(key, value, member)
            except ConfigError:
                pass
        raise ConfigError(key, f"expected {_type_name(tp)}, got {value!r}")
    if origin is list:
        (item_type,) = typing.get_args(tp)
        if not isinstance(value, list | tuple):
            raise ConfigError(key, f"expected a list of {_type_name(item_type)}, got {value!r}")
        return [_coerce(f"{key}[{i}]", item, item_type) for i, item in enumerate(value)]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, bool):
        raise ConfigError(key, f"expected int, got {value!r}")
    if not isinstance(value, tp):
        raise ConfigError(key, f"expected {_type_name(tp)}, got {value!r}")
    return value


class _Section:
    """Type checking shared by every section: runs before the section's own range checks."""

    _name = ""

    def _check_types(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            key = f"{self._name}.{f.name}"
            setattr(self, f.name, _coerce(key, getattr(self, f.name), hints[f.name]))

    def _require(self, ok: bool, key: str, message: str) -> None:
        if not ok:
            raise ConfigError(f"{self._name}.{key}", f"{message}, got {getattr(self, key)!r}")


@dataclass
class ModelConfig(_Section):
    target_path: str
    num_draft_layers: int = 1
    block_size: int = 16
    target_layer_ids: list[int] | None = None
    mask_token_id: int | None = None
    dtype: str = "float32"
    target_rows_per_pass: int | None = None
    # Scored block positions per lm_head + cross-entropy chunk (`dflash.loss.chunked_head_loss`):
    # bounds the logits to [loss_chunk_size, vocab]; null: a group's scored positions at once.
    loss_chunk_size: int | None = DEFAULT_LOSS_CHUNK_SIZE
    _name = "model"

    def __post_init__(self) -> None:
        self._check_types()
        self._require(bool(self.target_path), "target_path", "must name a local model directory")
        self._require(self.num_draft_layers >= 1, "num_draft_layers", "must be >= 1")
        self._require(self.block_size >= 2, "block_size", "must be >= 2 (anchor plus at least one draft)")
        if self.target_layer_ids is not None:
            self._require(len(self.target_layer_ids) >= 1, "target_layer_ids", "must not be empty")
            self._require(min(self.target_layer_ids) >= 0, "target_layer_ids", "must be >= 0")
        if self.mask_token_id is not None:
            self._require(self.mask_token_id >= 0, "mask_token_id", "must be >= 0")
        self._require(self.dtype in DTYPES, "dtype", f"must be one of {', '.join(DTYPES)}")
        if self.target_rows_per_pass is not None:
            self._require(self.target_rows_per_pass >= 1, "target_rows_per_pass", "must be >= 1")
        if self.loss_chunk_size is not None:
            self._require(self.loss_chunk_size >= 1, "loss_chunk_size",
                          "must be >= 1 (scored positions per lm_head chunk) or null (no chunking)")


@dataclass
class DataConfig(_Section):
    path: str
    max_length: int = 512
    batch_size: int = 4
    max_anchors: int = 512
    # Held-out JSON lines (same format) for the loss and tau every run.eval_every steps; none: no
    # held-out evaluation. Only the first eval_examples rows are used.
    eval_path: str | None = None
    eval_examples: int = 16
    _name = "data"

    def __post_init__(self) -> None:
        self._check_types()
        self._require(bool(self.path), "path", "must name a JSON-lines file")
        self._require(self.eval_path is None or bool(self.eval_path), "eval_path",
                      "must name a JSON-lines file or be null")
        self._require(self.eval_examples >= 1, "eval_examples", "must be >= 1")
        self._require(self.max_length >= 2, "max_length", "must be >= 2")
        self._require(self.batch_size >= 1, "batch_size", "must be >= 1")
        self._require(self.max_anchors >= 1, "max_anchors", "must be >= 1")


@dataclass
class OptimConfig(_Section):
    lr: float = 6.0e-4
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04
    max_grad_norm: float = 1.0
    total_steps: int = 1000
    gamma: float | None = None
    _name = "optim"

    def __post_init__(self) -> None:
        self._check_types()
        self._require(self.lr > 0, "lr", "must be > 0")
        self._require(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        self._require(0 <= self.warmup_ratio < 1, "warmup_ratio", "must be in [0, 1)")
        self._require(self.max_grad_norm > 0, "max_grad_norm", "must be > 0")
        self._require(self.total_steps >= 1, "total_steps", "must be >= 1")
        if self.gamma is not None:
            self._require(self.gamma > 0, "gamma", "must be > 0")


@dataclass
class RunConfig(_Section):
    output_dir: str
    save_every: int = 100
    keep_checkpoints: int = 3
    log_every: int = 1
    eval_every: int = 100  # steps between held-out evaluations (when data.eval_path is set)
    seed: int = 0
    resume: bool = True
    max_steps_per_run: int | None = None
    step_delay: float = 0.0
    _name = "run"

    def __post_init__(self) -> None:
        self._check_types()
        self._require(bool(self.output_dir), "output_dir", "must name a directory")
        self._require(self.save_every >= 1, "save_every", "must be >= 1")
        self._require(self.keep_checkpoints >= 1, "keep_checkpoints", "must be >= 1")
        self._require(self.log_every >= 1, "log_every", "must be >= 1")
        self._require(self.eval_every >= 1, "eval_every", "must be >= 1")
        if self.max_steps_per_run is not None:
            self._require(self.max_steps_per_run >= 1, "max_steps_per_run", "must be >= 1")
        self._require(self.step_delay >= 0, "step_delay", "must be >= 0")


@dataclass
class PipelineConfig(_Section):
    device: str = "cpu"
    target_gpus: list[int] = field(default_factory=list)
    drafter_gpus: list[int] = field(default_factory=list)
    target_workers: int = 0
    drafter_workers: int = 0
    queue_depth: int = 4
    threads_per_worker: int = 1
    max_restarts: int = 3
    # A run across several containers ("members"): every member's worker counts in member order,
    # [{"host": "ct200", "drafters": 1, "targets": 1}, ...] (this member's entry must match its own
    # layout above; host, optional, names the member);
    # this member's index; the c10d rendezvous endpoint "host:port" on member 0; this member's
    # own address (torchrun's --local-addr; the rendezvous and the collectives' sockets use it).
    members: list[dict] = field(default_factory=list)
    member: int = 0
    rendezvous: str = ""
    address: str = ""
    # Seconds a member waits at the rendezvous for the others (a member that never comes fails the rest).
    rendezvous_timeout: int = 600
    _name = "pipeline"

    def __post_init__(self) -> None:
        self._check_types()
        self._require(self.device in DEVICES, "device", f"must be one of {', '.join(DEVICES)}")
        for key in ("target_gpus", "drafter_gpus"):
            self._require(all(g >= 0 for g in getattr(self, key)), key, "GPU indices must be >= 0")
        overlap = set(self.target_gpus) & set(self.drafter_gpus)
        self._require(not overlap, "drafter_gpus",
                      f"shares GPUs {sorted(overlap)} with target_gpus (each GPU runs either a target worker "
                      f"or a drafter worker: list it in one of the two lists only)")
        self._require(self.target_workers >= 0, "target_workers", "must be >= 0")
        self._require(self.drafter_workers >= 0, "drafter_workers", "must be >= 0")
        self._require(self.queue_depth >= 1, "queue_depth", "must be >= 1")
        self._require(self.threads_per_worker >= 1, "threads_per_worker", "must be >= 1")
        self._require(self.max_restarts >= 0, "max_restarts", "must be >= 0")
        self._require(self.rendezvous_timeout >= 1, "rendezvous_timeout", "must be >= 1")
        if self.is_multi_process:
            self._check_layout()
        if self.members:
            self._check_members()

    def _check_members(self) -> None:
        """A run across members: every member with its counts, this one's matching its layout."""
        def require(ok: bool, key: str, message: str) -> None:
            if not ok:
                raise ConfigError(f"pipeline.{key}", message)

        require(self.is_multi_process, "members",
                "needs this member's layout (target and drafter workers or GPUs)")
        for i, entry in enumerate(self.members):
            key = f"members[{i}]"
            require({"drafters", "targets"} <= set(entry) <= {"host", "drafters", "targets"}, key,
                    f"must have the keys drafters and targets (and host, its name), got {sorted(entry)}")
            for name in ("drafters", "targets"):
                value = entry[name]
                require(isinstance(value, int) and not isinstance(value, bool) and value >= 0,
                        f"{key}.{name}", f"must be an integer >= 0, got {value!r}")
            # Each member logs the run's steps and keeps its own copy of the checkpoints: it needs a drafter.
            require(entry["drafters"] >= 1, f"{key}.drafters",
                    "must be >= 1 (each member's first drafter logs the steps and keeps the checkpoints)")
        require(0 <= self.member < len(self.members), "member",
                f"must be an index into members (0..{len(self.members) - 1}), got {self.member}")
        drafters, targets = self.local_counts
        own = self.members[self.member]
        require((own["drafters"], own["targets"]) == (drafters, targets), f"members[{self.member}]",
                f"says {own['drafters']} drafter(s) and {own['targets']} target(s), this member's layout "
                f"has {drafters} and {targets}")
        host, _, port = self.rendezvous.rpartition(":")
        require(bool(host) and port.isdigit() and 0 < int(port) < 65536, "rendezvous",
                f"must be host:port (the c10d endpoint on member 0), got {self.rendezvous!r}")

    def _check_layout(self) -> None:
        """The rules a worker layout must follow wherever it runs (the GPUs it may use are checked
        by `check_visible_gpus`, where the run starts or is validated)."""
        if self.device == "cuda":
            if self.target_workers or self.drafter_workers:
                raise ConfigError("pipeline", "target_workers/drafter_workers are for device cpu; "
                                  "on cuda list the GPUs in target_gpus and drafter_gpus")
            if not self.target_gpus or not self.drafter_gpus:
                raise ConfigError("pipeline", "device cuda needs at least one target GPU and one drafter "
                                  f"GPU, got target_gpus={self.target_gpus} drafter_gpus={self.drafter_gpus}")
            for key in ("target_gpus", "drafter_gpus"):
                gpus = getattr(self, key)
                self._require(len(set(gpus)) == len(gpus), key, "lists a GPU twice")
        else:
            if self.target_gpus or self.drafter_gpus:
                raise ConfigError("pipeline", "target_gpus/drafter_gpus need device cuda; "
                                  "on cpu use target_workers and drafter_workers")
            if self.target_workers < 1 or self.drafter_workers < 1:
                raise ConfigError("pipeline", "a cpu pipeline needs target_workers >= 1 and drafter_workers "
                                  f">= 1, got {self.target_workers} and {self.drafter_workers}")

    def check_visible_gpus(self, n_visible_gpus: int) -> None:
        """Refuse a cuda layout that names GPUs this machine does not have."""
        if self.device != "cuda":
            return
        for key in ("target_gpus", "drafter_gpus"):
            beyond = sorted(g for g in getattr(self, key) if g >= n_visible_gpus)
            if beyond:
                raise ConfigError(f"pipeline.{key}", f"GPUs {beyond} do not exist here "
                                  f"({n_visible_gpus} visible: 0..{n_visible_gpus - 1})")

    @property
    def local_counts(self) -> tuple[int, int]:
        """(drafters, targets) of this member's layout."""
        if self.device == "cuda":
            return len(self.drafter_gpus), len(self.target_gpus)
        return self.drafter_workers, self.target_workers

    @property
    def member_counts(self) -> list[tuple[int, int]]:
        """(drafters, targets) of every member of the run, in member order (this one alone when the
        run has no `members`)."""
        if not self.members:
            return [self.local_counts]
        return [(m["drafters"], m["targets"]) for m in self.members]

    @property
    def is_multi_process(self) -> bool:
        """True when the layout asks for separate target and drafter workers."""
        return bool(self.target_gpus or self.drafter_gpus or self.target_workers or self.drafter_workers)


@dataclass
class TrainConfig:
    model: ModelConfig
    data: DataConfig
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=lambda: RunConfig(output_dir="runs/main"))
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if not isinstance(getattr(self, f.name), SECTIONS[f.name]):
                raise ConfigError(f.name, f"expected a {SECTIONS[f.name].__name__}")
        if self.model.block_size > self.data.max_length:
            raise ConfigError("model.block_size", f"{self.model.block_size} does not fit in "
                              f"data.max_length {self.data.max_length}: no block could be trained")

    @property
    def gamma(self) -> float:
        """Loss decay constant: the configured one, else the paper's value for the block size."""
        return self.optim.gamma if self.optim.gamma is not None else default_gamma(self.model.block_size)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS = {
    "model": ModelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "run": RunConfig,
    "pipeline": PipelineConfig,
}


def default_gamma(block_size: int) -> float:
    """The paper's decay constants (7 for b=16, 5 for b=10, 4 for b=8), else b/2 - 1 (at least 1)."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, block_size / 2 - 1))


def _section_from_dict(name: str, raw) -> object:
    cls = SECTIONS[name]
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(name, f"expected a mapping, got {raw!r}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(name, f"unknown key(s) {', '.join(map(str, unknown))} "
                          f"(known: {', '.join(sorted(known))})")
    missing = sorted(
        f.name for f in dataclasses.fields(cls)
        if f.name not in raw and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    )
    if missing:
        raise ConfigError(name, f"missing required key(s) {', '.join(missing)}")
    return cls(**raw)


def config_from_dict(raw) -> TrainConfig:
    """Build a validated TrainConfig from a plain mapping (the parsed YAML)."""
    if not isinstance(raw, dict):
        raise ConfigError("config", f"expected a mapping at the top level, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
        raise ConfigError("config", f"unknown section(s) {', '.join(map(str, unknown))} "
                          f"(known: {', '.join(SECTIONS)})")
    for required in ("model", "data"):
        if required not in raw:
            raise ConfigError("config", f"missing section {required}")
    return TrainConfig(**{name: _section_from_dict(name, raw[name]) for name in SECTIONS if name in raw})


def target_shape(target_path: str) -> tuple[int, int]:
    """(decoder layers, vocabulary size) of the target saved at `target_path`, from its config.json."""
    config_file = Path(target_path) / "config.json"
    if not config_file.is_file():
        raise ConfigError("model.target_path", f"no model at {target_path!r} (expected {config_file})")
    try:
        raw = json.loads(config_file.read_text())
        text = raw.get("text_config") or raw
        return int(text["num_hidden_layers"]), int(text["vocab_size"])
    except (ValueError, KeyError, TypeError) as exc:
        message = f"cannot read num_hidden_layers and vocab_size from {config_file}: {exc!r}"
        raise ConfigError("model.target_path", message) from exc


def check_against_target(cfg: TrainConfig) -> None:
    """Checks that need the target on disk: it exists, the layer ids are within its depth and the
    mask token within its embedding and none of its stop or pad tokens."""
    n_layers, vocab_size = target_shape(cfg.model.target_path)
    ids = cfg.model.target_layer_ids
    if ids is not None and max(ids) >= n_layers:
        raise ConfigError("model.target_layer_ids", f"{ids} out of range for a target with {n_layers} layers "
                          f"(valid ids are 0..{n_layers - 1})")
    mask = cfg.model.mask_token_id
    problem = None if mask is None else mask_token_problem(mask, cfg.model.target_path, vocab_size)
    if problem is not None:
        raise ConfigError("model.mask_token_id", problem)


def check_data(cfg: TrainConfig) -> None:
    """The training data (and the held-out data, if any) are files on this machine."""
    for key in ("path", "eval_path"):
        value = getattr(cfg.data, key)
        if value is None:
            continue
        path = Path(value)
        if not path.is_file():
            what = "a directory" if path.is_dir() else "no file"
            raise ConfigError(f"data.{key}", f"{what} at {value!r} (expected a JSON-lines file)")


def check_output_dir(cfg: TrainConfig) -> None:
    """The run can write its outputs where the config says: no symbolic link, no other user's directory."""
    # checkpoint.CHECKPOINT_DIR and telemetry.TENSORBOARD_DIR (both import torch, which config does not).
    problem = output_dir_problem(cfg.run.output_dir, ("checkpoints", "tensorboard"))
    if problem:
        raise ConfigError("run.output_dir", f"{problem}: the run would write where another user (or the "
                          "link) chose; remove it or point run.output_dir elsewhere")


def load_config(path: str | Path, check_target: bool = True) -> TrainConfig:
    """Read, validate and return the YAML config at `path`; raise ConfigError on any problem.
    `check_target` also checks it against this machine: the target and the data on disk, the
    visible GPUs."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError("config", f"cannot read {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError("config", f"{path} is not valid YAML: {exc}") from exc
    cfg = config_from_dict(raw)
    if check_target:
        check_against_target(cfg)
        check_data(cfg)
        check_output_dir(cfg)
        cfg.pipeline.check_visible_gpus(len(visible_devices()))
    return cfg


def dump_config(cfg: TrainConfig) -> str:
    """The config as YAML that `load_config` reads back to an equal TrainConfig."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash.config", description="Check a training config.")
    sub = parser.add_subparsers(dest="command", required=True)
    validate = sub.add_parser("validate", help="exit 0 if the config is valid, else print why and exit 2")
    validate.add_argument("config", help="path to the YAML training config")
    validate.add_argument("--no-target-check", action="store_true",
                          help="skip the checks that need this machine: the target model and the data "
                               "on disk, the GPUs of the layout")
    validate.add_argument("--json", action="store_true",
                          help='print one JSON object on stdout: {"ok": true} or {"ok": false, "key": '
                               '"data.batch_size", "message": "expected int, got \'four\'"} (exit 2)')
    args = parser.parse_args(argv)
    try:
        load_config(args.config, check_target=not args.no_target_check)
    except ConfigError as exc:
        if args.json:
            print(json.dumps({"ok": False, "config": str(args.config), "key": exc.key,
                              "message": exc.message}))
        else:
            print(f"invalid config {args.config}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"ok": True, "config": str(args.config)}) if args.json else f"{args.config}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
