"""The training config's sections (model, data, optim, run, pipeline): one typed dataclass each,
whose `__post_init__` checks its own keys. `dflash_ops.config` puts them together into `TrainConfig`
and loads the YAML; import them from there."""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from fractions import Fraction

DTYPES = ("float32", "bfloat16")
# model.loss_chunk_size's default: at Qwen3-8B's vocabulary a chunk's logits and their gradient
# take ~0.6 GiB, and 512-row matmuls keep the lm_head's throughput.
DEFAULT_LOSS_CHUNK_SIZE = 512
DEVICES = ("cpu", "cuda")
LAYER_TYPES = ("full_attention", "sliding_attention")  # dflash_ops.model.drafter's, without importing torch
FEATURE_CHECKS = ("checksums", "sizes")
LOSS_WEIGHTINGS = ("decay", "dpace")  # optim.loss_weighting
SCHEDULES = ("cosine", "linear", "constant")  # optim.schedule (dflash_ops.training.trainer.lr_multiplier)
ATTENTION_BACKENDS = ("auto", "flex", "tiles")  # model.attention_backend (dflash_ops.model.flex)
MODEL_KINDS = ("dflash", "dspark")  # model.kind (dflash_ops.model.dspark)
DEFAULT_TOTAL_STEPS = 1000  # optim.total_steps when neither it nor optim.epochs is set
# run.report_to (TensorBoard's event files are written whatever it says)
REPORT_TO = ("tensorboard", "mlflow")


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type or out of range: `key` names it (a dotted
    path such as `data.batch_size`, or a section), `message` says what is wrong with it."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


def type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def coerce(key: str, value, tp):
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
                return coerce(key, value, member)
            except ConfigError:
                pass
        raise ConfigError(key, f"expected {type_name(tp)}, got {value!r}")
    if origin is list:
        (item_type,) = typing.get_args(tp)
        if not isinstance(value, list | tuple):
            raise ConfigError(key, f"expected a list of {type_name(item_type)}, got {value!r}")
        return [coerce(f"{key}[{i}]", item, item_type) for i, item in enumerate(value)]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, bool):
        raise ConfigError(key, f"expected int, got {value!r}")
    if not isinstance(value, tp):
        raise ConfigError(key, f"expected {type_name(tp)}, got {value!r}")
    return value


class Section:
    """Type checking shared by every section: runs before the section's own range checks."""

    _name = ""

    def _check_types(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            key = f"{self._name}.{f.name}"
            setattr(self, f.name, coerce(key, getattr(self, f.name), hints[f.name]))

    def _require(self, ok: bool, key: str, message: str) -> None:
        if not ok:
            raise ConfigError(f"{self._name}.{key}", f"{message}, got {getattr(self, key)!r}")


@dataclass
class ModelConfig(Section):
    target_path: str
    num_draft_layers: int = 1
    block_size: int = 16
    target_layer_ids: list[int] | None = None
    mask_token_id: int | None = None
    dtype: str = "float32"
    target_rows_per_pass: int | None = None
    # Scored block positions per lm_head + cross-entropy chunk (`dflash_ops.model.loss.chunked_head_loss`):
    # bounds the logits to [loss_chunk_size, vocab]; null: a group's scored positions at once.
    loss_chunk_size: int | None = DEFAULT_LOSS_CHUNK_SIZE
    # One of LAYER_TYPES per draft layer (null: all full_attention), and the window W in tokens of
    # the sliding ones: a query at position p sees keys at positions p-W+1..p (docs/SERVING.md).
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    # The drafter's attention (`dflash_ops.model.flex.choose_attention`): auto (FlexAttention compiled on
    # CUDA, the block-sparse tiles elsewhere), flex, or tiles.
    attention_backend: str = "auto"
    # dflash, or dspark: the DFlash backbone with a Markov head of rank markov_rank and, with
    # confidence_head, an acceptance head (`dflash_ops.model.dspark`).
    kind: str = "dflash"
    markov_rank: int = 256
    confidence_head: bool = False
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
        self._require(self.attention_backend in ATTENTION_BACKENDS, "attention_backend",
                      f"must be one of {', '.join(ATTENTION_BACKENDS)}")
        self._check_layer_types()
        self._require(self.kind in MODEL_KINDS, "kind", f"must be one of {', '.join(MODEL_KINDS)}")
        self._require(self.markov_rank >= 1, "markov_rank", "must be >= 1")

    def _check_layer_types(self) -> None:
        types = self.layer_types or []
        if self.layer_types is not None:
            n = self.num_draft_layers
            self._require(len(types) == n, "layer_types", f"must have model.num_draft_layers ({n}) entries")
            self._require(set(types) <= set(LAYER_TYPES), "layer_types", f"takes {' or '.join(LAYER_TYPES)}")
        window, sliding = self.sliding_window, LAYER_TYPES[1] in types
        self._require(window is not None or not sliding, "sliding_window",
                      "must be set (>= 1, tokens) for sliding_attention layers")
        self._require(window is None or window >= 1, "sliding_window", "must be >= 1 (tokens)")
        self._require(window is None or sliding, "sliding_window", "applies to no layer: "
                      "make some of model.layer_types sliding_attention, or set it to null")


@dataclass
class DataConfig(Section):
    path: str
    max_length: int = 512
    batch_size: int = 4
    max_anchors: int = 512
    # Drop the training examples with fewer loss tokens than this (after max_length), as SpecForge's
    # data preparation dropped those with fewer than 2 * block_size; null: keep every example.
    min_loss_tokens: int | None = None
    # Held-out JSON lines (same format) for the loss and tau every run.eval_every steps; none: no
    # held-out evaluation. Only the first eval_examples rows are used.
    eval_path: str | None = None
    eval_examples: int = 16
    # A feature cache (python -m dflash_ops.capture) read instead of the target. Verified at every start (and
    # by validate): `sizes`, every shard there at its manifest's size; `checksums`, every shard hashed too (at
    # the recipe's ~41 KB a token, hours for a whole data set: on request, after a copy or a disk fault).
    features_path: str | None = None
    features_verify: str = "sizes"
    # The thinking mode (a chat template's enable_thinking) the data was regenerated in and the drafter
    # is served in; regenerated data whose manifest records the other mode is refused
    # (dflash_ops.data.data_manifest). false: the public Qwen3 DFlash drafters' non-thinking mode.
    enable_thinking: bool = False
    _name = "data"

    def __post_init__(self) -> None:
        self._check_types()
        self._require(bool(self.path), "path", "must name a JSON-lines file")
        self._require(self.eval_path is None or bool(self.eval_path), "eval_path",
                      "must name a JSON-lines file or be null")
        self._require(self.eval_examples >= 1, "eval_examples", "must be >= 1")
        self._require(self.features_path is None or bool(self.features_path), "features_path",
                      "must name a feature cache directory or be null")
        self._require(self.features_verify in FEATURE_CHECKS, "features_verify",
                      f"must be one of {', '.join(FEATURE_CHECKS)}")
        self._require(self.max_length >= 2, "max_length", "must be >= 2")
        self._require(self.batch_size >= 1, "batch_size", "must be >= 1")
        self._require(self.max_anchors >= 1, "max_anchors", "must be >= 1")
        self._require(self.min_loss_tokens is None or self.min_loss_tokens >= 1, "min_loss_tokens",
                      "must be >= 1 (loss tokens) or null")


@dataclass
class OptimConfig(Section):
    lr: float = 6.0e-4
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04
    max_grad_norm: float = 1.0
    # The run's length, one or the other: optimizer steps, or passes over the training data, which the
    # run turns into steps once it has counted data.path's examples (`steps_for_epochs`). Neither set:
    # DEFAULT_TOTAL_STEPS steps.
    total_steps: int | None = None
    epochs: float | None = None
    gamma: float | None = None
    # How the block positions' cross entropies are weighted (dflash_ops.model.loss): decay, DFlash's fixed
    # exp(-(k-1)/gamma); dpace, D-PACE's weights from the drafter's own confidence (dpace_alpha its
    # smoothing), as SpecForge defines them.
    loss_weighting: str = "decay"
    dpace_alpha: float = 0.5
    # The learning rate after the linear warmup (warmup_ratio of the steps): cosine or linear decay to 0 at
    # the last step, or constant at optim.lr.
    schedule: str = "cosine"
    # Micro-batches of data.batch_size rows per drafter per optimizer step (gradient accumulation): the step
    # is the one of a batch of accumulate x batch_size rows, one token-weighted mean over all of them.
    accumulate: int = 1
    _name = "optim"

    def __post_init__(self) -> None:
        self._check_types()
        self._require(self.lr > 0, "lr", "must be > 0")
        self._require(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        self._require(0 <= self.warmup_ratio < 1, "warmup_ratio", "must be in [0, 1)")
        self._require(self.max_grad_norm > 0, "max_grad_norm", "must be > 0")
        if self.total_steps is not None and self.epochs is not None:
            raise ConfigError("optim.epochs", f"optim.total_steps ({self.total_steps}) and optim.epochs "
                              f"({self.epochs}) are mutually exclusive: set one and leave the other out "
                              "(or null)")
        if self.epochs is None:
            self.total_steps = DEFAULT_TOTAL_STEPS if self.total_steps is None else self.total_steps
            self._require(self.total_steps >= 1, "total_steps", "must be >= 1")
        else:
            self._require(self.epochs > 0 and math.isfinite(self.epochs), "epochs", "must be > 0")
        if self.gamma is not None:
            self._require(self.gamma > 0, "gamma", "must be > 0")
        self._require(self.loss_weighting in LOSS_WEIGHTINGS, "loss_weighting",
                      f"must be one of {', '.join(LOSS_WEIGHTINGS)}")
        self._require(0 <= self.dpace_alpha <= 1, "dpace_alpha", "must be in [0, 1]")
        self._require(self.schedule in SCHEDULES, "schedule", f"must be one of {', '.join(SCHEDULES)}")
        self._require(self.accumulate >= 1, "accumulate", "must be >= 1 (micro-batches per optimizer step)")


def steps_for_epochs(epochs: float, examples: int, batch_size: int, drafters: int,
                     accumulate: int = 1) -> int:
    """The optimizer steps of `epochs` passes over `examples`: a step takes `accumulate` batches of
    `batch_size` examples per drafter, and the data order runs on across epochs without a short batch
    (`dflash_ops.data.examples.BatchOrder`), so the run has seen epochs x examples once
    ceil(epochs x examples / (batch_size x drafters x accumulate)) steps are done. `epochs` counts as the
    decimal it is written as (0.1 is a tenth, not the nearest binary fraction)."""
    wanted = Fraction(repr(float(epochs))) * examples
    return max(1, math.ceil(wanted / (batch_size * drafters * accumulate)))


@dataclass
class RunConfig(Section):
    output_dir: str
    save_every: int = 100
    keep_checkpoints: int = 3
    # Never prune the checkpoint of the best held-out tau (the one export --best takes), beside the latest
    # keep_checkpoints; needs data.eval_path.
    keep_best: bool = False
    log_every: int = 1
    eval_every: int = 100  # steps between held-out evaluations (when data.eval_path is set)
    seed: int = 0
    resume: bool = True
    max_steps_per_run: int | None = None
    step_delay: float = 0.0
    # Where the run writes its Prometheus metrics for node_exporter's textfile collector
    # (dflash_ops.run.metrics; empty: none), and the labels of every series (the deploy sets container,
    # node and run).
    metrics_textfile_dir: str = ""
    metrics_labels: dict = field(default_factory=dict)
    # An MLflow tracking server that gets the run's params and metrics too
    # (dflash_ops.training.mlflow_tracking; empty: none), or `report_to: [mlflow]` with the server from the
    # run's MLFLOW_TRACKING_URI (SpecForge's tracker names; tensorboard is always written), and the
    # experiment the run goes in.
    mlflow_uri: str = ""
    mlflow_experiment: str = "dflash"
    report_to: list[str] = field(default_factory=list)
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
        self._require(all(isinstance(k, str) and re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", k) and k != "member"
                          and isinstance(v, str | int) for k, v in self.metrics_labels.items()),
                      "metrics_labels", "must map Prometheus label names (not member) to strings")
        self._require(not self.mlflow_uri or re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", self.mlflow_uri),
                      "mlflow_uri", "must be a tracking URI with its scheme (http://host:5000)")
        self._require(bool(self.mlflow_experiment.strip()), "mlflow_experiment", "must name an experiment")
        self._require(all(name in REPORT_TO for name in self.report_to), "report_to",
                      f"must list trackers among {', '.join(REPORT_TO)}")


@dataclass
class PipelineConfig(Section):
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
            if not self.drafter_gpus:
                raise ConfigError("pipeline", "device cuda needs at least one drafter GPU, got "
                                  f"target_gpus={self.target_gpus} drafter_gpus={self.drafter_gpus}")
            for key in ("target_gpus", "drafter_gpus"):
                gpus = getattr(self, key)
                self._require(len(set(gpus)) == len(gpus), key, "lists a GPU twice")
        else:
            if self.target_gpus or self.drafter_gpus:
                raise ConfigError("pipeline", "target_gpus/drafter_gpus need device cuda; "
                                  "on cpu use target_workers and drafter_workers")
            if self.drafter_workers < 1:
                raise ConfigError("pipeline", "a cpu pipeline needs drafter_workers >= 1, got "
                                  f"{self.drafter_workers} (and target_workers {self.target_workers})")

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
