"""Each rank's peak memory for a training config, term by term, and whether it fits the GPUs it gets.

`predict(cfg, shape)` returns, for the target role and the drafter role, the named terms (bytes) whose
sum is that rank's peak: arithmetic on the shapes (weights, gradients, AdamW state, DDP's buckets,
the feature queue) plus per-element coefficients measured on CPU (BENCHMARKS.md sections 5 and 9, and
the full-width rehearsal, section 13). docs/SCALE.md explains each term; this module is where the
figures live. `refusal(...)` says what does not fit, with the knob to turn. No torch: `python -m
dflash_ops.config validate` runs it before anything is stopped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dflash_ops.core.config import ConfigError, TrainConfig
from dflash_ops.core.loss_section import capture_layer_ids, needs_target
from dflash_ops.core.target_layers import build_target_layer_ids

GiB = 1 << 30
MiB = 1 << 20
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
# The scored logits and cross entropy held at once, per (scored position, vocabulary entry): unchunked,
# bf16 logits, their float32 log-probabilities and gradient (BENCHMARKS.md section 9: 11.0 bytes); one
# chunk's logits and gradient while they exist (6 bytes).
LOSS_BYTES_UNCHUNKED = 11.0
LOSS_BYTES_CHUNK = 6.0
# A loss against the target's distribution (loss.kind other than ce: dflash_ops.model.distill.mix_chunk, the
# DSpark head's recomputed chunk), per (scored position, vocabulary entry) of a chunk: the drafter's and the
# target's bf16 logits and up to nine float32 [rows, vocab] tensors at its peak (log q, q, log p, p, the
# gradient, q - p, its sign and two products): counted from the code, not measured on a GPU.
LOSS_BYTES_TARGET_CHUNK = 40.0
# A step's working set per (query, hidden channel), from section 9's chunked steps at H 4096 (bf16
# autocast): each draft layer's saved activations and bf16 weight copies, the 5-layer step's growth over
# the 1-layer step's at 4096 queries ((4.96 - 1.80) GiB / 4 layers); and what a query holds outside
# the layers (block embeddings, hidden states and their fp32 gradient), the 1-layer step's growth from
# 4096 to 8192 queries ((3.06 - 1.80) GiB) less one layer's share. Against section 9's four chunked
# figures these predict 0.94x to 1.15x.
LAYER_ACTIVATION_BYTES = 50.6
QUERY_ACTIVATION_BYTES = 30.0
# The target's capture working set per (row of a pass, token, hidden channel), in elements of the
# target's dtype: CAPTURE_WORKING_BASE plus CAPTURE_WORKING_PER_MLP per unit of intermediate / hidden (the
# MLP's gate and up outputs and their product, I wide each). `benchmarks/heldout_capture.py` measured a
# pass of 8 rows x 512 at H 256 with I 512, 768 and 1024: 10.1, 13.1 and 16.1 (BENCHMARKS.md section 15);
# section 5's 10 at I = 2H is the same line. Qwen3's MLP is 3H: 13. A packed pass (the documents in one
# row, `dflash_ops.data.target.target_document_states`) also holds RoPE's cos and sin for each of its
# tokens, head_dim wide each, where a padded pass held them once per position: CAPTURE_WORKING_ROPE per
# unit of head_dim / hidden (0.5 at H 128 with heads of 32, measured 10.55 against 10.0; 0.06 at Qwen3-8B).
CAPTURE_WORKING_BASE = 4.0
CAPTURE_WORKING_PER_MLP = 3.0
CAPTURE_WORKING_ROPE = 2.0
# What a process holds before its model: the CUDA context and its kernels on a GPU (an estimate until
# the GPU check measures it; nvidia-smi sees it, torch's allocator does not); on CPU the rehearsal
# measures Python + torch + the trainer's imports and passes it in (`runtime_bytes`).
CUDA_RUNTIME_BYTES = 1 * GiB
# The caching allocator's blocks reserved beyond those allocated, as a share of the allocated peak: the
# GPU check's drafter step at the recipe's shape (flex, fixed shapes) reserved 33.76 GiB for 32.79
# allocated on one H200 (docs/SCALE.md, "Step time"), 3 %. Shapes that change step to step fragment more.
ALLOCATOR_RESERVE = 0.03
# NCCL's buffers, allocated by NCCL outside torch's allocator (nvidia-smi sees them, max_memory_reserved
# does not), from NCCL's defaults in src/init.cc and src/include/device.h: a channel's connection holds
# one buffer a protocol, SIMPLE 4 MiB (DEFAULT_BUFFSIZE), LL 512 KiB (8 lines x 512 threads x 8 steps x
# 16 bytes) and LL128 4,915,200 bytes (120 elements x 640 threads x 8 steps x 8 bytes). A collective
# communicator (DDP's all-reduce, the startup group's barrier) connects up to MAXCHANNELS = 32 channels,
# a ring and a tree connection each: an upper bound (NCCL picks fewer channels on a PCIe machine). A
# point-to-point peer (a target and a drafter it feeds) uses NCCL_P2P_CHANNELS_PER_PEER channels of
# 8 steps x P2P_NVL_CHUNKSIZE (512 KiB) each, SIMPLE only; NCCL rounds the per-peer count to a power of
# two from the topology, 8 assumed here until the GPU check reads it. NCCL_BUFFSIZE and
# NCCL_MAX_NCHANNELS shrink them.
NCCL_CONNECTION_BYTES = 4 * MiB + 512 * 1024 + 4_915_200
NCCL_MAX_CHANNELS = 32
NCCL_COLLECTIVE_CONNECTIONS = 2  # a ring and a tree connection a channel
NCCL_P2P_CHANNELS_PER_PEER = 8
NCCL_P2P_CHANNEL_BYTES = 8 * 512 * 1024


@dataclass(frozen=True)
class TargetShape:
    """What the memory model needs of the target's config.json."""

    num_layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool

    @classmethod
    def read(cls, target_path: str) -> TargetShape:
        config_file = Path(target_path) / "config.json"
        try:
            raw = json.loads(config_file.read_text())
            text = raw.get("text_config") or raw
            heads = int(text["num_attention_heads"])
            return cls(int(text["num_hidden_layers"]), int(text["hidden_size"]),
                       int(text["intermediate_size"]), heads, int(text.get("num_key_value_heads") or heads),
                       int(text.get("head_dim") or text["hidden_size"] // heads), int(text["vocab_size"]),
                       bool(raw.get("tie_word_embeddings", False)))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError("model.target_path", f"cannot read the target's shape from {config_file}: "
                              f"{exc!r}") from exc

    def layer_parameters(self) -> int:
        """One decoder layer of this shape (the drafter's layers are the target's)."""
        h, d = self.hidden, self.head_dim
        attention = 2 * h * self.heads * d + 2 * h * self.kv_heads * d + 2 * d
        return attention + 3 * h * self.intermediate + 2 * h

    def head_parameters(self) -> int:
        """The input embedding and the lm_head (one tensor when tied)."""
        return self.vocab * self.hidden * (1 if self.tied else 2)


# Qwen3-8B's config.json (the recipe's target): the shape the measured figures were taken at.
QWEN3_8B = TargetShape(num_layers=36, hidden=4096, intermediate=12288, heads=32, kv_heads=8, head_dim=128,
                       vocab=151936, tied=False)


@dataclass(frozen=True)
class RolePeak:
    """One rank's predicted peak: (term name, bytes) in the order docs/SCALE.md lists them."""

    role: str
    terms: tuple[tuple[str, int], ...]

    @property
    def total(self) -> int:
        return sum(b for _, b in self.terms)

    def table(self) -> str:
        rows = [f"  {name:<26} {b / GiB:6.2f} GiB" for name, b in self.terms]
        return "\n".join([f"{self.role}: {self.total / GiB:.2f} GiB", *rows])


def drafter_parameters(cfg: TrainConfig, shape: TargetShape) -> int:
    """The drafter's trainable parameters: `fc` over the k target features, its layers, two norms."""
    k = len(feature_layer_ids(cfg, shape))
    layers = cfg.model.num_draft_layers * shape.layer_parameters()
    return k * shape.hidden * shape.hidden + layers + 2 * shape.hidden + dspark_head_parameters(cfg, shape)


def dspark_head_parameters(cfg: TrainConfig, shape: TargetShape) -> int:
    """DSpark's heads (model.kind dspark, `dflash_ops.model.dspark`): markov_w1 and markov_w2, vocab x rank
    each, and the confidence head's hidden + rank weights and bias; 0 for DFlash."""
    m = cfg.model
    if m.kind != "dspark":
        return 0
    return 2 * shape.vocab * m.markov_rank + ((shape.hidden + m.markov_rank + 1) if m.confidence_head else 0)


def feature_layer_ids(cfg: TrainConfig, shape: TargetShape) -> list[int]:
    return cfg.model.target_layer_ids or build_target_layer_ids(shape.num_layers, cfg.model.num_draft_layers)


def sent_layer_ids(cfg: TrainConfig, shape: TargetShape) -> list[int]:
    """The layers a target rank captures and sends: the drafter's, and the last one when loss.kind needs the
    target's distribution (its last hidden state: `dflash_ops.core.loss_section.capture_layer_ids`)."""
    return capture_layer_ids(feature_layer_ids(cfg, shape), shape.num_layers, cfg.loss.mix)


def nccl_bytes(cfg: TrainConfig, role: str) -> int:
    """NCCL's buffers on one rank of a CUDA pipeline: the startup group's collective communicator, the
    drafters' all-reduce (more than one drafter), and a point-to-point peer for each rank of the other
    role (an upper bound: a rank exchanges batches with the other role's ranks the schedule pairs it
    with)."""
    p = cfg.pipeline
    if p.device != "cuda" or not p.is_multi_process:
        return 0
    targets = sum(t for _, t in p.member_counts)
    drafters = sum(n for n, _ in p.member_counts)
    collective = NCCL_COLLECTIVE_CONNECTIONS * NCCL_MAX_CHANNELS * NCCL_CONNECTION_BYTES
    peer = NCCL_P2P_CHANNELS_PER_PEER * NCCL_P2P_CHANNEL_BYTES
    if role == "target":
        return collective + drafters * peer
    return collective * (2 if drafters > 1 else 1) + targets * peer


def with_reserve(role: str, terms: list[tuple[str, int]], on_gpu: bool) -> RolePeak:
    """The role's peak: its terms and, on a GPU, the caching allocator's reserve over what torch allocates
    (every term but the CUDA context and NCCL's buffers, which are not the allocator's)."""
    allocated = sum(b for n, b in terms if n not in ("runtime", "nccl_buffers"))
    reserve = int(ALLOCATOR_RESERVE * allocated) if on_gpu else 0
    return RolePeak(role, (*terms, ("allocator_reserve", reserve)))


def drafter_peak(cfg: TrainConfig, shape: TargetShape, runtime_bytes: int) -> RolePeak:
    """A drafter rank: the frozen head, fp32 masters, gradients, DDP's buckets, AdamW, one document
    group's step (a group is about one full-length document: max_length tokens, max_anchors blocks),
    the received feature batches and the held-out features."""
    m, d, p = cfg.model, cfg.data, cfg.pipeline
    dtype = DTYPE_BYTES[m.dtype]
    params = drafter_parameters(cfg, shape)
    k = len(feature_layer_ids(cfg, shape))
    queries = d.max_anchors * m.block_size
    scored = d.max_anchors * (m.block_size - 1)
    drafters = sum(n for n, _ in p.member_counts) if p.is_multi_process else 1
    loss = (min(m.loss_chunk_size, scored) * LOSS_BYTES_CHUNK if m.loss_chunk_size is not None
            else scored * LOSS_BYTES_UNCHUNKED) * shape.vocab
    # A loss against the target's distribution holds the target's logits and both distributions
    # (LOSS_BYTES_TARGET_CHUNK a chunk's entry), and each batch carries the target's last hidden state as one
    # more feature column.
    if needs_target(cfg.loss.mix):
        loss = min(m.loss_chunk_size or scored, scored) * LOSS_BYTES_TARGET_CHUNK * shape.vocab
    sent = len(sent_layer_ids(cfg, shape))
    feature_batch = d.batch_size * d.max_length * sent * shape.hidden * dtype
    queued = p.queue_depth + 1 if p.is_multi_process else 1  # the queue plus the batch in training
    on_gpu = p.device == "cuda"
    terms = [
        ("runtime", runtime_bytes),
        ("target_head", shape.head_parameters() * dtype),
        ("drafter_weights_fp32", 4 * params),
        ("gradients_fp32", 4 * params),
        # DDP's reducer copies the gradients into buckets of its own (gradient_as_bucket_view off).
        ("ddp_buckets", 4 * params if drafters > 1 else 0),
        ("nccl_buffers", nccl_bytes(cfg, "drafter")),
        ("adamw_state_fp32", 8 * params),
        # On a GPU AdamW runs its foreach path (torch/optim/adam.py, _multi_tensor_adam): a temporary the
        # size of the parameters in fp32, `scaled_device_grads` and then `exp_avg_sq_sqrt`, one at a time.
        ("adamw_temporaries", 4 * params if on_gpu else 0),
        ("layer_activations", int(m.num_draft_layers * LAYER_ACTIVATION_BYTES * queries * shape.hidden)),
        ("query_activations", int(QUERY_ACTIVATION_BYTES * queries * shape.hidden)),
        ("loss_chunk" if m.loss_chunk_size is not None else "loss_unchunked", int(loss)),
        ("feature_queue", queued * feature_batch),
        ("heldout_features", d.eval_examples * d.max_length * k * shape.hidden * dtype if d.eval_path else 0),
    ]
    return with_reserve("drafter", terms, on_gpu)


def capture_working_elements(shape: TargetShape) -> float:
    """A capture pass's working set per (row, token, hidden channel), in elements of the model dtype."""
    return (CAPTURE_WORKING_BASE + CAPTURE_WORKING_PER_MLP * shape.intermediate / shape.hidden
            + CAPTURE_WORKING_ROPE * shape.head_dim / shape.hidden)


def target_peak(cfg: TrainConfig, shape: TargetShape, runtime_bytes: int) -> RolePeak:
    """A target rank: its weights, the packed features of a batch and the capture's working set. On a GPU
    every weight is copied to the device. On CPU the weights stay mapped from the safetensors file and
    only the pages read are resident: the layers up to the deepest captured one (the capture stops
    there), and neither the embedding (a batch reads a few of its rows) nor the lm_head."""
    m, d = cfg.model, cfg.data
    dtype = DTYPE_BYTES[m.dtype]
    ids = sent_layer_ids(cfg, shape)
    rows = min(m.target_rows_per_pass or d.batch_size, d.batch_size)
    on_gpu = cfg.pipeline.device == "cuda"
    layers = shape.num_layers if on_gpu else max(ids) + 1
    tokens = d.batch_size * d.max_length
    working = capture_working_elements(shape)
    terms = [
        ("runtime", runtime_bytes),
        ("target_layers", (layers * shape.layer_parameters() + shape.hidden) * dtype),
        ("target_embedding_and_head", shape.head_parameters() * dtype if on_gpu else 0),
        ("nccl_buffers", nccl_bytes(cfg, "target")),
        ("features_out", tokens * len(ids) * shape.hidden * dtype),
        ("capture_working_set", int(working * rows * d.max_length * shape.hidden * dtype)),
    ]
    return with_reserve("target", terms, on_gpu)


def predict(cfg: TrainConfig, shape: TargetShape | None = None,
            runtime_bytes: int | None = None) -> list[RolePeak]:
    """The peak of each kind of rank the config starts: a target rank (when it has one) and a drafter
    rank. A single process (no pipeline layout) holds both."""
    shape = shape or TargetShape.read(cfg.model.target_path)
    if runtime_bytes is None:
        runtime_bytes = CUDA_RUNTIME_BYTES if cfg.pipeline.device == "cuda" else 0
    drafter = drafter_peak(cfg, shape, runtime_bytes)
    has_target = cfg.data.features_path is None
    if not cfg.pipeline.is_multi_process:
        if not has_target:
            return [drafter]
        target = target_peak(cfg, shape, 0)
        # One process: the drafter's head is the target's own embedding and lm_head.
        shared = ("runtime", "target_embedding_and_head", "nccl_buffers", "allocator_reserve")
        merged = [(n, b) for n, b in drafter.terms if n != "allocator_reserve"] + [
            (n, b) for n, b in target.terms if n not in shared]
        return [with_reserve("single", merged, cfg.pipeline.device == "cuda")]
    targets = sum(t for _, t in cfg.pipeline.member_counts)
    return ([target_peak(cfg, shape, runtime_bytes)] if targets else []) + [drafter]


# The config key that shrinks each term (a refusal names the largest term's), and how.
KNOBS = {
    "loss_unchunked": ("model.loss_chunk_size", "e.g. 512: one chunk of the logits at a time"),
    "loss_chunk": ("model.loss_chunk_size", "fewer scored positions per lm_head chunk"),
    "layer_activations": ("data.max_anchors", "fewer blocks in a document group's step"),
    "query_activations": ("data.max_anchors", "fewer blocks in a document group's step"),
    "feature_queue": ("pipeline.queue_depth", "fewer received batches held, or a smaller data.batch_size"),
    "capture_working_set": ("model.target_rows_per_pass", "e.g. 1, or a smaller data.batch_size"),
    "features_out": ("data.batch_size", "fewer tokens a batch"),
    "heldout_features": ("data.eval_examples", "fewer held-out examples"),
}


def gpu_memory_of(cfg: TrainConfig, gpus: dict[int, int]) -> dict[str, list[tuple[int, int]]]:
    """(GPU index, bytes) of the GPUs each role gets: `gpus` maps an index to its memory."""
    p = cfg.pipeline
    if not p.is_multi_process:
        return {"single": [(0, gpus[0])] if 0 in gpus else []}
    return {"target": [(g, gpus[g]) for g in p.target_gpus if g in gpus],
            "drafter": [(g, gpus[g]) for g in p.drafter_gpus if g in gpus]}


# The terms no batch, anchor, chunk or queue setting changes: the weights, their gradients and optimizer
# state, the runtime. When they alone exceed a GPU, only another layout (or other GPUs) can fit.
FIXED_TERMS = ("runtime", "target_head", "drafter_weights_fp32", "gradients_fp32", "ddp_buckets",
               "nccl_buffers", "adamw_state_fp32", "adamw_temporaries", "target_layers",
               "target_embedding_and_head")
LAYOUT_CHANGE = {
    "target": "the target's weights need GPUs this large: larger GPUs, model.dtype bfloat16 if it is "
              "float32, or no target rank at all (a feature cache: python -m dflash_ops.capture once, "
              "data.features_path)",
    "drafter": "larger GPUs, model.dtype bfloat16 for the target's head if it is float32, or fewer "
               "model.num_draft_layers",
}


def fixed_bytes(peak: RolePeak) -> int:
    """The part of `peak` no batch or chunk setting shrinks (FIXED_TERMS)."""
    return sum(b for n, b in peak.terms if n in FIXED_TERMS)


def advice(peak: RolePeak, size: int) -> tuple[str, str]:
    """(the config key to turn, how) for `peak` over a GPU of `size` bytes: the key that shrinks its largest
    term a key can shrink; `pipeline` and the layout change when the fixed terms alone exceed the GPU (or
    nothing can shrink)."""
    fixed = fixed_bytes(peak)
    if fixed > size:
        return "pipeline", (f"the weights, gradients and optimizer state alone need {fixed / GiB:.1f} GiB, "
                            "more than the GPU: no batch, anchor or chunk setting fits; "
                            f"{LAYOUT_CHANGE[peak.role]}")
    turnable = [(b, n) for n, b in peak.terms if n in KNOBS and b]
    return KNOBS[max(turnable)[1]] if turnable else ("pipeline", "larger GPUs")


def failing_ranks(peaks: list[RolePeak], gpus: dict[str, list[tuple[int, int]]]) -> list[dict]:
    """Every rank whose predicted peak exceeds its GPU: role, GPU, GiB needed and had, the fixed terms' GiB,
    the key to turn (`advice`)."""
    return [{"role": peak.role, "gpu": index, "needs_gib": round(peak.total / GiB, 1),
             "has_gib": round(size / GiB, 1), "fixed_gib": round(fixed_bytes(peak) / GiB, 1),
             "key": advice(peak, size)[0]}
            for peak in peaks for index, size in gpus.get(peak.role, []) if peak.total > size]


def refusal(peaks: list[RolePeak], gpus: dict[str, list[tuple[int, int]]]) -> tuple[str, str] | None:
    """None when every rank's peak fits its GPU; else (the config key to turn, what does not fit): each
    role's ranks over their GPU, term by term, with `advice`'s key and how (the first role's key first)."""
    problems, keys = [], []
    for peak in peaks:
        over = [(index, size) for index, size in gpus.get(peak.role, []) if peak.total > size]
        if not over:
            continue
        index, size = min(over, key=lambda gpu: gpu[1])
        key, how = advice(peak, size)
        keys.append(key)
        gpus_named = ", ".join(str(i) for i, _ in over)
        problems.append(f"the {peak.role} rank needs {peak.total / GiB:.1f} GiB, GPU {index} has "
                        f"{size / GiB:.1f} GiB (over: GPU {gpus_named}); turn {key} ({how})\n{peak.table()}")
    return (keys[0], "\n".join(problems)) if problems else None


def summary(peaks: list[RolePeak], gpus: dict[str, list[tuple[int, int]]]) -> str:
    """One line: each role's predicted peak against the smallest GPU it gets."""
    parts = []
    for peak in peaks:
        sizes = [s for _, s in gpus.get(peak.role, [])]
        of = f" of {min(sizes) / GiB:.0f}" if sizes else ""
        parts.append(f"{peak.role} {peak.total / GiB:.1f} GiB{of}")
    return "memory fits: " + ", ".join(parts)


def parse_gpu_memory(text: str) -> int:
    """`--gpu-memory`: '141GiB', '80 GB', '81559MiB' or a bare number of GiB -> bytes. GB is read as
    the vendor's decimal gigabytes (an '80 GB' GPU reports 81559 MiB)."""
    raw = text.strip().replace(" ", "")
    units = {"gib": GiB, "gb": 10**9, "mib": MiB, "mb": 10**6, "": GiB}
    number = raw.rstrip("GgMmIiBb")
    unit = raw[len(number):].lower()
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in units or value <= 0:
        raise ConfigError("--gpu-memory", f"expected a size such as 141GiB, 80GB or 81559MiB, got {text!r}")
    return int(value * units[unit])


def parse_nvidia_smi(output: str) -> dict[int, int]:
    """`nvidia-smi --query-gpu=index,memory.total --format=csv,noheader,nounits` -> {index: bytes}."""
    gpus = {}
    for line in output.strip().splitlines():
        index, total = (x.strip() for x in line.split(","))
        gpus[int(index)] = int(float(total)) * MiB
    return gpus
