"""Training configuration: one typed dataclass per section, loaded from YAML.

`load_config(path)` maps the YAML onto `TrainConfig`; unknown keys and wrong types are errors that
name the key and the value. The command that checks a file, `python -m dflash_ops.config validate`, is
`dflash_ops/config.py`, above the layers whose checks it runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from dflash_ops.core import data_rows, token_store
from dflash_ops.core.devices import visible_devices
from dflash_ops.core.loss_section import LossConfig
from dflash_ops.core.mask_token import mask_token_problem
from dflash_ops.core.safe_paths import output_dir_problem
from dflash_ops.core.sections import (  # noqa: F401 (re-exported: the config's names live in dflash_ops.core.config)
    DEFAULT_LOSS_CHUNK_SIZE,
    DEVICES,
    DTYPES,
    FEATURE_CHECKS,
    LAYER_TYPES,
    ConfigError,
    DataConfig,
    ModelConfig,
    OptimConfig,
    PipelineConfig,
    RunConfig,
    steps_for_epochs,
)


@dataclass
class TrainConfig:
    model: ModelConfig
    data: DataConfig
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=lambda: RunConfig(output_dir="runs/main"))
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    loss: LossConfig = field(default_factory=LossConfig)  # dflash_ops.core.loss_section
    # Not a key of the file: data.path's training examples once they are counted (`counted`), which
    # optim.epochs needs to become steps. Two configs that differ only here are the same config.
    examples: int | None = field(default=None, compare=False)
    # Not a key of the file either: what data.path's rows give under this config (`surveyed`), as the run's
    # start line and `validate` report it.
    data_counts: DataCounts | None = field(default=None, compare=False)
    # The command line's SECTION.KEY=VALUE items laid over the file (`load_config`), as the start line
    # echoes them.
    overrides: tuple[str, ...] = field(default=(), compare=False)
    # Not a key: the steps of an optim.epochs run resumed at another number of drafters, those that train
    # what its epochs have left (dflash_ops.training.checkpoint.resumed_epoch_steps).
    resumed_total_steps: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(name, f"expected a {cls.__name__}")
        if self.model.block_size > self.data.max_length:
            raise ConfigError("model.block_size", f"{self.model.block_size} does not fit in "
                              f"data.max_length {self.data.max_length}: no block could be trained")
        targets = sum(t for _, t in self.pipeline.member_counts)
        if self.pipeline.is_multi_process and (self.data.features_path is None) == (targets == 0):
            key = "pipeline.target_gpus" if self.pipeline.device == "cuda" else "pipeline.target_workers"
            raise ConfigError(key, "must name no target with data.features_path (the drafters read the "
                              f"cache), got {targets}" if targets else "names no target: the features need "
                              "one, or data.features_path (a feature cache: python -m dflash_ops.capture)")
        if self.pipeline.is_multi_process and self.data.features_path and self.data.eval_path:
            # The held-out features come from target rank 0; no drafter loads the target (minutes of a
            # CPU forward at Qwen3-8B, ahead of the start's first collective).
            raise ConfigError("data.eval_path", "needs a target rank to compute the held-out features, and a "
                              "pipeline fed by a feature cache has none: set it to null and measure "
                              "held-out tau on a checkpoint with python -m dflash_ops.evaluate")
        if self.run.keep_best and not self.data.eval_path:
            raise ConfigError("run.keep_best", "keeps the checkpoint of the best held-out tau, and there is "
                              "none without data.eval_path: set one, or run.keep_best to false")
        if self.model.confidence_head and (self.model.kind != "dspark" or "bce" not in self.loss.mix):
            # Untrained, its weights would get no gradient (an error under DDP) and export at random.
            raise ConfigError("model.confidence_head", "is DSpark's acceptance head, trained by "
                              "loss.weights.bce: it needs model.kind dspark and a bce weight in loss.weights")
        if "bce" in self.loss.mix and not (self.model.kind == "dspark" and self.model.confidence_head):
            raise ConfigError("loss.weights", "bce trains DSpark's confidence head: needs model.kind dspark "
                              "and model.confidence_head true")
        if self.pipeline.is_multi_process and self.optim.accumulate > 1:
            # A pipeline's targets send each drafter one batch a step (dflash_ops.run.ranks).
            raise ConfigError("optim.accumulate", "must be 1 in a pipeline of several processes (each "
                              f"drafter takes one batch a step), got {self.optim.accumulate}: raise "
                              "data.batch_size, or add drafters")

    @property
    def gamma(self) -> float:
        """Loss decay constant: the configured one, else the paper's value for the block size."""
        return self.optim.gamma if self.optim.gamma is not None else default_gamma(self.model.block_size)

    @property
    def loss_weighting(self) -> dict:
        """How the block positions are weighted, as a checkpoint and an export record it: `{"loss_weighting":
        "decay", "gamma": g}` or `{"loss_weighting": "dpace", "dpace_alpha": a}`."""
        if self.optim.loss_weighting == "dpace":
            return {"loss_weighting": "dpace", "dpace_alpha": self.optim.dpace_alpha}
        return {"loss_weighting": "decay", "gamma": self.gamma}

    @property
    def drafters(self) -> int:
        """The run's drafter ranks, every member's: each optimizer step takes one batch per drafter."""
        if not self.pipeline.is_multi_process:
            return 1
        return sum(d for d, _ in self.pipeline.member_counts)

    @property
    def total_steps(self) -> int:
        """The optimizer steps the run takes: optim.total_steps, or those of optim.epochs passes over
        the counted examples (`steps_for_epochs`)."""
        if self.optim.epochs is None:
            return self.optim.total_steps
        if self.resumed_total_steps is not None:
            return self.resumed_total_steps
        if self.examples is None:
            raise ConfigError("optim.epochs", "the steps follow from data.path's size, which was not counted "
                              "(load the config with its data, or pass it through counted())")
        return steps_for_epochs(self.optim.epochs, self.examples, self.data.batch_size, self.drafters,
                                self.optim.accumulate)

    @property
    def step_plan(self) -> dict:
        """Where the step count comes from, as the run's start line logs it (optim.accumulate when over 1)."""
        accumulate = {"accumulate": self.optim.accumulate} if self.optim.accumulate > 1 else {}
        return {"epochs": self.optim.epochs, "examples": self.examples, "batch_size": self.data.batch_size,
                "drafters": self.drafters, **accumulate, "total_steps": self.total_steps}

    def to_dict(self) -> dict:
        """The sections, as the YAML file holds them."""
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}


SECTIONS = {
    "model": ModelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "run": RunConfig,
    "pipeline": PipelineConfig,
    "loss": LossConfig,
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


def local_model_problem(path: str, option: str = "model.target_path") -> str | None:
    """Why `path` is not a model directory on this machine (None when it is one): with the download command
    when it reads as a Hub id, since nothing is ever fetched at run time; `option` is what names it."""
    config_file = Path(path) / "config.json"
    if config_file.is_file():
        return None
    hint = ""
    if path.count("/") == 1 and not path.startswith((".", "/")) and not Path(path).exists():
        hint = (f"; {path!r} reads as a Hugging Face Hub id, and a local directory is needed (nothing is "
                f"downloaded at run time): run huggingface-cli download {path} --local-dir <dir> and give "
                f"that directory as {option}")
    return f"no model at {path!r} (expected {config_file}){hint}"


def target_text_config(target_path: str) -> dict:
    """The (text) config.json of the target saved at `target_path` (`local_model_problem` when none)."""
    config_file = Path(target_path) / "config.json"
    problem = local_model_problem(target_path)
    if problem:
        raise ConfigError("model.target_path", problem)
    try:
        raw = json.loads(config_file.read_text())
        text = raw.get("text_config") or raw
        if not isinstance(text, dict):
            raise TypeError(f"expected an object, got {type(text).__name__}")
        return text
    except (ValueError, TypeError) as exc:
        raise ConfigError("model.target_path", f"cannot read {config_file}: {exc!r}") from exc


def target_shape(target_path: str) -> tuple[int, int]:
    """(decoder layers, vocabulary size) of the target saved at `target_path`, from its config.json."""
    text = target_text_config(target_path)
    try:
        return int(text["num_hidden_layers"]), int(text["vocab_size"])
    except (ValueError, KeyError, TypeError) as exc:
        message = (f"cannot read num_hidden_layers and vocab_size from {Path(target_path) / 'config.json'}: "
                   f"{exc!r}")
        raise ConfigError("model.target_path", message) from exc


def check_against_target(cfg: TrainConfig) -> None:
    """Checks that need the target on disk: it exists, the layer ids are within its depth and the
    mask token within its embedding and none of its stop or pad tokens."""
    n_layers, vocab_size = target_shape(cfg.model.target_path)
    positions = target_text_config(cfg.model.target_path).get("max_position_embeddings")
    if isinstance(positions, int) and cfg.data.max_length > positions:
        raise ConfigError("data.max_length", f"{cfg.data.max_length} is over the target's "
                          f"max_position_embeddings ({positions}): its positions beyond were never trained; "
                          f"set data.max_length to {positions} or less")
    ids = cfg.model.target_layer_ids
    if ids is not None and max(ids) >= n_layers:
        raise ConfigError("model.target_layer_ids", f"{ids} out of range for a target with {n_layers} layers "
                          f"(valid ids are 0..{n_layers - 1})")
    mask = cfg.model.mask_token_id
    problem = None if mask is None else mask_token_problem(mask, cfg.model.target_path, vocab_size)
    if problem is not None:
        raise ConfigError("model.mask_token_id", problem)


def check_data(cfg: TrainConfig) -> None:
    """The training data (and the held-out data, if any) are files on this machine. (A feature cache is
    checked above this layer, by whoever reads it: `dflash_ops.config validate`, the launcher, the cached
    run.)"""
    for key in ("path", "eval_path"):
        value = getattr(cfg.data, key)
        if value is None:
            continue
        path = Path(value)
        if not path.is_file():
            what = "a directory" if path.is_dir() else "no file"
            raise ConfigError(f"data.{key}", f"{what} at {value!r} (expected a JSON-lines file)")


def count_examples(path: str | Path, max_length: int, min_loss_tokens: int | None = None) -> int:
    """The training examples of the JSON-lines file at `path` as `dflash_ops.data.examples.load_examples`
    keeps them: its non-blank lines, less (with `min_loss_tokens`) those with fewer loss tokens within
    `max_length`. No tensors and no checks: whoever loads them checks the count (`with_examples`), and a
    malformed line, counted here, is refused there."""
    def kept(line: str) -> bool:
        if min_loss_tokens is None:
            return True
        try:
            return sum(json.loads(line)["loss_mask"][:max_length]) >= min_loss_tokens
        except (ValueError, KeyError, TypeError):
            return True

    store = token_store.fresh_store(path) if Path(path).is_file() else None
    if store is not None:  # the rows the trainer reads (dflash_ops.data.examples.training_examples)
        return int(store.kept_rows(max_length, min_loss_tokens).size)
    try:
        with Path(path).open() as f:
            return sum(1 for line in f if line.strip() and kept(line))
    except OSError as exc:
        raise ConfigError("data.path", f"cannot read {path}: {exc.strerror}") from exc


@dataclass(frozen=True)
class DataCounts:
    """data.path's rows under a config: all of them, those that form at least one block (an anchor a with
    loss_mask[a] = loss_mask[a+1] = 1 and a <= length - block_size, within data.max_length, and kept by
    data.min_loss_tokens), and those data.max_length cuts."""

    rows: int
    trainable: int
    cut: int
    filtered: int = 0  # of the rows that form no block: those data.min_loss_tokens drops
    eval_rows: int | None = None  # data.eval_path's rows, when it names one

    def as_fields(self) -> dict:
        return {"rows": self.rows, "trainable_rows": self.trainable, "cut_rows": self.cut}

    def warning(self, data) -> str | None:
        """What a user should hear about these counts under the config's `data` section, None when every
        row trains whole and the held-out set has the rows asked for."""
        said = []
        if self.trainable != self.rows or self.cut:
            said.append(f"{self.rows - self.trainable} of {self.rows} rows form no block and are not trained "
                        f"on; data.max_length {data.max_length} cuts {self.cut} rows")
        if self.eval_rows is not None and data.eval_examples > self.eval_rows:
            said.append(f"data.eval_examples is {data.eval_examples}, data.eval_path holds {self.eval_rows} "
                        f"rows: {self.eval_rows} are evaluated")
        return "; ".join(said) or None


def _forms_block(mask: list[int], block_size: int) -> bool:
    return any(mask[a] and mask[a + 1] for a in range(len(mask) - block_size + 1))


def survey_data(cfg: TrainConfig, vocab_size: int | None = None, strict: bool = False) -> DataCounts:
    """Count data.path's rows, trainable rows and rows max_length cuts (`DataCounts`) in one streaming pass.
    A malformed line counts as a row that trains (the loader refuses it, naming the line), unless `strict`
    (a run about to train): then every row is read as the trainer reads it and one it would refuse is
    refused here, with its words (`dflash_ops.core.data_rows`: the JSON, the lists, the ids within
    `vocab_size`, an empty file), or, when a fresh token store lies beside data.path (what the trainer then
    reads), the store's manifest and index are checked instead (its rows are read only when its largest id
    is beyond `vocab_size`)."""
    data, rows, trainable, cut, filtered = cfg.data, 0, 0, 0, 0
    path = data_rows.data_file(data.path) if strict else Path(data.path)
    store = token_store.fresh_store(path) if path.is_file() else None
    if store is not None:  # what the trainer reads (dflash_ops.data.examples.training_examples)
        if strict:
            data_rows.check_store(path, store, data.max_length, vocab_size, data.min_loss_tokens)
        return DataCounts(*data_rows.store_counts(store, data.max_length, cfg.model.block_size,
                                                  data.min_loss_tokens))
    try:
        for line_no, line in data_rows.text_lines(path):
            rows += 1
            if strict:
                where = f"{path}:{line_no}"
                ids, mask = data_rows.parse_row(line, where)
                data_rows.check_vocabulary(max(ids[: data.max_length]), vocab_size, where)
                row = {"input_ids": ids, "loss_mask": mask}
            try:
                if not strict:
                    row = json.loads(line)
                cut += len(row["input_ids"]) > data.max_length
                mask = row["loss_mask"][: data.max_length]
                if data.min_loss_tokens is not None and sum(mask) < data.min_loss_tokens:
                    filtered += 1
                else:
                    trainable += _forms_block(mask, cfg.model.block_size)
            except (ValueError, KeyError, TypeError, IndexError):
                trainable += 1
    except OSError as exc:
        raise ConfigError("data.path", f"cannot read {data.path}: {exc.strerror}") from exc
    if strict and not rows:
        raise data_rows.no_examples(path, data.min_loss_tokens, 0)
    return DataCounts(rows, trainable, cut, filtered)


def surveyed(cfg: TrainConfig, vocab_size: int | None = None, strict: bool = False) -> TrainConfig:
    """`cfg` with its data counted (`survey_data`, `strict` with the target's `vocab_size` for a run about to
    train); a config under which no row forms a block is refused."""
    counts = survey_data(cfg, vocab_size, strict)
    if counts.rows and not counts.trainable and counts.filtered:
        raise ConfigError("data.min_loss_tokens", f"{cfg.data.path} holds no examples with "
                          f"{cfg.data.min_loss_tokens} loss tokens or more (data.min_loss_tokens; "
                          f"{counts.filtered} fewer)" + ("" if counts.filtered == counts.rows else
                                                          ", and its other rows form no block"))
    if counts.rows and not counts.trainable:
        raise ConfigError("data.max_length", f"no row of {cfg.data.path} forms a block: {counts.rows} rows, "
                          f"{counts.cut} cut at data.max_length {cfg.data.max_length}; a row needs two loss "
                          f"tokens in a row at least model.block_size ({cfg.model.block_size}) tokens before "
                          "its cut end: raise data.max_length or lower model.block_size")
    if cfg.data.eval_path is not None:
        try:  # the held-out rows, read as the run's held-out loader reads them when `strict`
            eval_rows = (data_rows.checked_rows(cfg.data.eval_path, cfg.data.max_length, vocab_size)
                         if strict else count_examples(cfg.data.eval_path, cfg.data.max_length))
        except data_rows.DataError as exc:
            raise ConfigError("data.eval_path", exc.message) from exc
        counts = dataclasses.replace(counts, eval_rows=eval_rows)
    return dataclasses.replace(cfg, data_counts=counts)


def with_examples(cfg: TrainConfig, examples: int) -> TrainConfig:
    """`cfg` knowing that data.path holds `examples` training examples (those the loader keeps), when
    optim.epochs needs them; a count other than the one it was loaded with is refused (the file changed
    under the run)."""
    check_batch_rows(cfg, examples)
    if cfg.optim.epochs is None:
        return cfg
    if cfg.examples is not None and cfg.examples != examples:
        raise ConfigError("data.path", f"{cfg.data.path} holds {examples} examples, {cfg.examples} when the "
                          "config was loaded and optim.epochs became steps: the file changed; start again")
    return dataclasses.replace(cfg, examples=examples)


def check_batch_rows(cfg: TrainConfig, examples: int) -> None:
    """Refuse a step's batch (data.batch_size x drafters x optim.accumulate rows) larger than the training
    examples: the data order would put the same rows into one step more than once."""
    rows = cfg.data.batch_size * cfg.drafters * cfg.optim.accumulate
    if examples and rows > examples:
        factors = [f"data.batch_size {cfg.data.batch_size}"]
        factors += [f"{cfg.drafters} drafters"] if cfg.drafters > 1 else []
        factors += [f"optim.accumulate {cfg.optim.accumulate}"] if cfg.optim.accumulate > 1 else []
        largest = max(1, examples // (rows // cfg.data.batch_size))
        raise ConfigError("data.batch_size", f"a step takes {rows} rows ({' x '.join(factors)}) but "
                          f"{cfg.data.path} holds {examples} training examples: rows would repeat within a "
                          f"step; set data.batch_size to at most {largest}, or add data")


def counted(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with data.path's examples counted when optim.epochs needs them (once: a count it holds stays)."""
    if cfg.optim.epochs is None or cfg.examples is not None:
        return cfg
    return with_examples(cfg, count_examples(cfg.data.path, cfg.data.max_length, cfg.data.min_loss_tokens))


def check_output_dir(cfg: TrainConfig) -> None:
    """The run can write its outputs where the config says: no symbolic link, no other user's directory."""
    # checkpoint.CHECKPOINT_DIR and telemetry.TENSORBOARD_DIR (both import torch, which config does not).
    problem = output_dir_problem(cfg.run.output_dir, ("checkpoints", "tensorboard"))
    if problem:
        raise ConfigError("run.output_dir", f"{problem}: the run would write where another user (or the "
                          "link) chose; remove it or point run.output_dir elsewhere")


def writable_problem(directory: str | Path) -> str | None:
    """Why the run could not create its files in `directory` (or, while it does not exist, in the nearest
    directory above it that does, where the run would create it); None when it can. Asked of the kernel
    (access(2): a read-only mount, the permissions), then proven by a probe file of a fresh name, created
    and removed at once (root passes access(2) wherever the mount is writable): nothing the run or a live
    run there reads or writes is touched."""
    path = Path(directory).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    if not path.is_dir():
        return None  # not a directory on the way: output_dir_problem says so
    where = "" if path == Path(directory).absolute() else f" (where {directory} would be created)"
    if not os.access(path, os.W_OK | os.X_OK):
        reason = "is on a read-only mount" if os.statvfs(path).f_flag & os.ST_RDONLY else "is not writable"
        return f"{path} {reason}{where}"
    try:
        fd, probe = tempfile.mkstemp(prefix=".dflash-write-probe-", dir=path)
    except OSError as exc:
        return f"{path}: cannot create a file in it{where}: {exc.strerror}"
    os.close(fd)
    os.unlink(probe)
    return None


def check_writable_output_dir(cfg: TrainConfig) -> None:
    """The run can create its files in run.output_dir (`writable_problem`)."""
    problem = writable_problem(cfg.run.output_dir)
    if problem:
        raise ConfigError("run.output_dir", f"{problem}: the run could write no checkpoint; point "
                          "run.output_dir at a writable directory")


def check_device(cfg: TrainConfig) -> None:
    """A cuda layout needs a GPU this process can see (`visible_devices`: CUDA_VISIBLE_DEVICES, else the
    driver's /dev/nvidiaN); whether torch can use it is `validate`'s check of its build."""
    if cfg.pipeline.device == "cuda" and not visible_devices():
        why = "CUDA_VISIBLE_DEVICES is empty" if "CUDA_VISIBLE_DEVICES" in os.environ else "no /dev/nvidiaN"
        raise ConfigError("pipeline.device", "'cuda' requested but no CUDA device is visible "
                          f"({why}): run on a machine with a GPU, or set pipeline.device to "
                          "cpu")


class _Loader(yaml.SafeLoader):
    """YAML as a config is written: `3e-3` is a float (YAML 1.1, PyYAML's, reads a float only with a dot)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def read_yaml(text: str):
    """The YAML document `text`, floats such as `3e-3` included (yaml.YAMLError when it is not YAML)."""
    return yaml.load(text, Loader=_Loader)  # a SafeLoader: plain data only


def parse_overrides(items: list[str] | tuple[str, ...]) -> dict[str, dict]:
    """`["optim.lr=1e-3", "run.output_dir=runs/b"]` -> {"optim": {"lr": 0.001}, "run": {...}}: each value
    read as YAML (so `null`, `[1, 2]`, `true` mean what they mean in the file); ConfigError for an item
    that is not SECTION.KEY=VALUE. Keys and types are checked where the file's are (`config_from_dict`)."""
    sections: dict[str, dict] = {}
    for item in items:
        key, sep, text = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or not section or not name or "." in name:
            raise ConfigError("config", f"override {item!r}: expected SECTION.KEY=VALUE (optim.lr=1e-3)")
        try:
            value = read_yaml(text) if text.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(key, f"override {item!r}: the value is not YAML: {exc}") from exc
        sections.setdefault(section, {})[name] = value
    return sections


def apply_overrides(raw, overrides: dict[str, dict]):
    """The parsed config file `raw` with `overrides` (`parse_overrides`) laid over its sections."""
    if not overrides or not isinstance(raw, dict):
        return raw
    merged = dict(raw)
    for section, values in overrides.items():
        base = merged.get(section)
        merged[section] = {**(base if isinstance(base, dict) else {}), **values}
    return merged


def load_config(path: str | Path, check_target: bool = True, overrides: list[str] | tuple[str, ...] = (),
                training: bool = True) -> TrainConfig:
    """Read, validate and return the YAML config at `path`, with `overrides` (SECTION.KEY=VALUE, as on the
    command line) laid over it; raise ConfigError on any problem.
    `check_target` also checks it against this machine: the target and the data on disk, the output
    directory, the visible GPUs; and counts data.path's examples when optim.epochs needs them. With
    `training` too (`train`, its `--dry-run`, its workers, `validate`; not a command that only reads a run,
    such as `evaluate`), what the run itself would refuse is refused here, with the run's words: data.path's
    rows read as the trainer reads them (`survey_data`), run.output_dir writable, a GPU for a cuda layout."""
    path = Path(path)
    try:
        raw = read_yaml(path.read_text())
    except OSError as exc:
        raise ConfigError("config", f"cannot read {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError("config", f"{path} is not valid YAML: {exc}") from exc
    cfg = config_from_dict(apply_overrides(raw, parse_overrides(overrides)))
    if overrides:
        cfg = dataclasses.replace(cfg, overrides=tuple(overrides))
    if check_target:
        check_against_target(cfg)
        check_data(cfg)
        check_output_dir(cfg)
        cfg.pipeline.check_visible_gpus(len(visible_devices()))
        if training:
            check_device(cfg)
            check_writable_output_dir(cfg)
        try:
            cfg = counted(surveyed(cfg, target_shape(cfg.model.target_path)[1], strict=training))
        except data_rows.DataError as exc:
            raise ConfigError(exc.key or "data.path", exc.message) from exc
    return cfg


def dump_config(cfg: TrainConfig) -> str:
    """The config as YAML that `load_config` reads back to an equal TrainConfig."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
