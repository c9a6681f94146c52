"""The DFlash drafter: a few Qwen3-style decoder layers that predict a block of tokens at once.

Inputs, all packed (no batch dimension; documents are told apart by the attention mask):
- context features `[T, k*H]`: k target hidden layers per real token, projected by `fc` to H and
  RMS-normalised; injected as extra keys and values into every layer (KV injection). The context
  skips the layers' input norm, o_proj and MLP.
- block tokens `[Q]`: for each block, the anchor token then `mask_token_id` x (b-1), embedded with
  the target's frozen embedding; queries come from the block only.
- positions: the context's and the blocks' positions within their documents, for RoPE.
- the attention pattern, built by `dflash_ops.model.loss`: a block pattern with `attend` (what training
  uses: `dflash_ops.model.flex.FlexBlockMask`, FlexAttention on the device, or the tiles of
  `dflash_ops.model.attention.BlockSparseMask`), the dense boolean reference `[Q, T+Q]` (True = may
  attend), or None (every block query sees every key: one block after the whole context, as in decoding).
- per layer, its type (`DrafterConfig.layer_types`): a `full_attention` layer uses that pattern as
  it is; a `sliding_attention` layer keeps of it only what Hugging Face's sliding window of
  `sliding_window` = W allows (`sliding_window_mask`): a query at position p sees the keys at
  positions p-W+1 .. p, itself included. Inside a block that is causal, and the anchor's query sees
  at most the W-1 context tokens before the anchor (docs/SERVING.md: what the engines run).
Output: hidden states `[Q, H]` after the final norm; `logits()` applies the target's frozen lm_head.

The layers' elementwise work (norms, RoPE, SiLU-mul, the residual add, the casts into each matmul's
dtype) runs in regions (`Regions`): as written by default (what an export serves with), under
torch.compile when the trainer asks for it on CUDA (`DraftStack.compile_regions`).

This file imports nothing but torch: an export ships it unchanged next to `modeling_dflash.py`, so
that the serving side runs the very layers that were trained.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)  # as transformers' Qwen3Config, vLLM and SGLang spell them


class BlockMask(Protocol):
    """A block-sparse attention pattern (`dflash_ops.model.flex.FlexBlockMask`,
    `dflash_ops.model.attention.BlockSparseMask`)."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool) -> torch.Tensor: ...

    def with_window(self, window: int) -> BlockMask:
        """The same pattern less what a sliding window of `window` tokens hides (`sliding_window_mask`)."""
        ...


def sliding_window_mask(q_positions: torch.Tensor, kv_positions: torch.Tensor, window: int) -> torch.Tensor:
    """`[Q, K]` bool: Hugging Face's sliding window (transformers' `sliding_attention`, vLLM's and
    SGLang's window of the same size): a query at position p may see a key at position k when
    p - window < k <= p. Positions are within the document."""
    lag = q_positions[:, None] - kv_positions[None, :]
    return (lag >= 0) & (lag < window)


def windowed(attention_mask: torch.Tensor | BlockMask | None, window: int | None, q_positions: torch.Tensor,
             kv_positions: torch.Tensor) -> torch.Tensor | BlockMask | None:
    """`attention_mask` for a layer with sliding window `window` (None: a full attention layer)."""
    if window is None:
        return attention_mask
    if attention_mask is None or isinstance(attention_mask, torch.Tensor):
        sliding = sliding_window_mask(q_positions, kv_positions, window)
        return sliding if attention_mask is None else attention_mask & sliding
    return attention_mask.with_window(window)


def rope_theta_of(config) -> float:
    """The RoPE base of a transformers config: `rope_parameters` (transformers 5), else the top-level
    `rope_theta` (transformers 4), else Qwen3's 1e6."""
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
    return float(theta if theta is not None else 1_000_000.0)


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_layers: int
    num_target_features: int  # k: target layers concatenated in the context features
    block_size: int
    mask_token_id: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    layer_types: list[str] | None = None  # one of LAYER_TYPES per layer; None: all full_attention
    sliding_window: int | None = None     # W of the sliding_attention layers (None when there are none)

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "num_layers", "num_target_features", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"DrafterConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.block_size < 2:
            raise ValueError(f"DrafterConfig.block_size must be >= 2, got {self.block_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} outside the vocabulary ({self.vocab_size})")
        self.layer_types = list(self.layer_types or [FULL_ATTENTION] * self.num_layers)
        if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= set(LAYER_TYPES):
            raise ValueError(f"layer_types {self.layer_types} must give one of {', '.join(LAYER_TYPES)} "
                             f"for each of the {self.num_layers} layers")
        sliding = SLIDING_ATTENTION in self.layer_types
        if sliding != (self.sliding_window is not None) or (sliding and self.sliding_window < 1):
            raise ValueError(f"sliding_window {self.sliding_window} must be >= 1 with sliding_attention "
                             f"layers and None without them (layer_types {self.layer_types})")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`; None for a full attention layer."""
        return self.sliding_window if self.layer_types[layer] == SLIDING_ATTENTION else None

    @classmethod
    def from_target_config(cls, target_config, num_layers: int, num_target_features: int, block_size: int,
                           mask_token_id: int, layer_types: list[str] | None = None,
                           sliding_window: int | None = None) -> DrafterConfig:
        """Take the attention/MLP shapes and RoPE settings of a transformers Qwen3-style config."""
        rope = getattr(target_config, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default":
            raise ValueError(f"target RoPE type {rope_type!r} is not supported (only 'default')")
        heads = target_config.num_attention_heads
        return cls(
            hidden_size=target_config.hidden_size,
            intermediate_size=target_config.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(target_config, "num_key_value_heads", None) or heads,
            head_dim=getattr(target_config, "head_dim", None) or target_config.hidden_size // heads,
            num_layers=num_layers,
            num_target_features=num_target_features,
            block_size=block_size,
            mask_token_id=mask_token_id,
            vocab_size=target_config.vocab_size,
            rms_norm_eps=target_config.rms_norm_eps,
            rope_theta=rope_theta_of(target_config),
            layer_types=layer_types,
            sliding_window=sliding_window,
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.regions = EAGER  # the region functions it runs (`DraftStack.compile_regions`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.regions.rms_norm(x, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """The RoPE frequencies `[head_dim / 2]`, float32 (transformers' `inv_freq` of the same base)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos, sin `[N, head_dim]` for integer positions `[N]` (rotate-half layout, as in Qwen3)."""
    inv_freq = rope_inv_freq(head_dim, theta, positions.device)
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[1, heads, N, D]` rotated by cos/sin `[N, D]`."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# The layers' elementwise work, as regions: functions of tensors that run as written (`EAGER`, the
# reference every device can run) or each under torch.compile with its row count dynamic
# (`compiled_regions()`, what training uses on CUDA: one fused kernel for a region's forward and one
# or two for its backward, one compilation for every group's rows). Each region's outputs that feed a
# matmul are in the dtype that matmul runs in (the context's: bf16 under autocast), one copy per
# matmul as autocast would cast them, so that their gradients still add up in float32.


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, returned in x's dtype (under autocast the fp32 master weight must not
    promote bf16 activations)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * x32).to(x.dtype)


def attention_inputs(block: torch.Tensor, weight: torch.Tensor, eps: float, context: torch.Tensor):
    """The layer's input norm of the block `[Q, H]` and what q_proj, k_proj and v_proj read, in the
    context's dtype: the normed block, and twice the keys' and values' input `[T+Q, H]` (KV injection:
    the context's rows first, then the block's)."""
    normed = rms_norm(block, weight, eps)
    kv_input = torch.cat([context, normed], dim=0)
    return normed.to(context.dtype), kv_input.to(context.dtype), kv_input.to(context.dtype)


def norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
              sin: torch.Tensor) -> torch.Tensor:
    """q_norm or k_norm of x `[N, heads, D]`, then RoPE: `[1, heads, N, D]`."""
    return apply_rope(rms_norm(x, weight, eps).transpose(0, 1).unsqueeze(0), cos, sin)


def mlp_inputs(block: torch.Tensor, update: torch.Tensor, weight: torch.Tensor, eps: float):
    """The attention's residual add and the post-attention norm: the new block, and twice its norm in
    the update's dtype (what gate_proj and up_proj read)."""
    block = block + update
    normed = rms_norm(block, weight, eps)
    return block, normed.to(update.dtype), normed.to(update.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def compile_rows_dynamic(fn):
    """`fn` under torch.compile, the first dimension of each tensor argument that is not a Parameter (the
    rows: tokens, block queries, a chunk's rows) dynamic from the first call and every other dimension
    static (the widths, which the kernels specialise on): one compilation serves every group's rows."""
    compiled = torch.compile(fn)

    def call(*args):
        for arg in args:
            if isinstance(arg, torch.Tensor) and not isinstance(arg, nn.Parameter) and arg.dim():
                torch._dynamo.maybe_mark_dynamic(arg, 0)
        return compiled(*args)

    call.__name__ = call.__qualname__ = fn.__name__
    return call


class Regions:
    """The region functions, as they are or under torch.compile (`compile_rows_dynamic`)."""

    NAMES = ("rms_norm", "attention_inputs", "norm_rope", "mlp_inputs", "silu_mul")

    def __init__(self, compiled: bool):
        self.compiled = compiled
        for name in self.NAMES:
            fn = globals()[name]
            setattr(self, name, compile_rows_dynamic(fn) if compiled else fn)


EAGER = Regions(compiled=False)
_COMPILED_REGIONS: list[Regions] = []


def compiled_regions() -> Regions:
    """The compiled regions (one set per process, so that every drafter shares its compilations)."""
    if not _COMPILED_REGIONS:
        _COMPILED_REGIONS.append(Regions(compiled=True))
    return _COMPILED_REGIONS[0]


class DraftAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, q_input: torch.Tensor, k_input: torch.Tensor, v_input: torch.Tensor, rope_q, rope_kv,
                attention_mask: torch.Tensor | BlockMask | None) -> torch.Tensor:
        """Attention of the normed block `q_input` `[Q, H]` over `k_input`/`v_input` `[T+Q, H]` (KV
        injection: the context's rows first, then the block's; `attention_inputs`)."""
        cfg, regions = self.cfg, self.q_norm.regions
        n_q, n_kv = q_input.shape[0], k_input.shape[0]
        q = self.q_proj(q_input).view(n_q, cfg.num_attention_heads, cfg.head_dim)
        k = self.k_proj(k_input).view(n_kv, cfg.num_key_value_heads, cfg.head_dim)
        v = self.v_proj(v_input).view(n_kv, cfg.num_key_value_heads, cfg.head_dim)
        q = regions.norm_rope(q, self.q_norm.weight, self.q_norm.eps, *rope_q)
        k = regions.norm_rope(k, self.k_norm.weight, self.k_norm.eps, *rope_kv)
        v = v.transpose(0, 1).unsqueeze(0)
        gqa = cfg.num_attention_heads != cfg.num_key_value_heads
        if attention_mask is None or isinstance(attention_mask, torch.Tensor):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, enable_gqa=gqa)
        else:
            out = attention_mask.attend(q, k, v, enable_gqa=gqa)
        out = out.squeeze(0).transpose(0, 1).reshape(n_q, cfg.num_attention_heads * cfg.head_dim)
        return self.o_proj(out)


class DraftMLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.regions = EAGER

    def forward(self, gate_input: torch.Tensor, up_input: torch.Tensor | None = None) -> torch.Tensor:
        """The SwiGLU MLP of `gate_input` (and `up_input`, the same values: `mlp_inputs`)."""
        up_input = gate_input if up_input is None else up_input
        return self.down_proj(self.regions.silu_mul(self.gate_proj(gate_input), self.up_proj(up_input)))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DraftMLP(cfg)

    def forward(self, block, context, rope_q, rope_kv, attention_mask):
        norm, post = self.input_layernorm, self.post_attention_layernorm
        regions = norm.regions
        attention = self.self_attn(*regions.attention_inputs(block, norm.weight, norm.eps, context),
                                   rope_q, rope_kv, attention_mask)
        block, gate_input, up_input = regions.mlp_inputs(block, attention, post.weight, post.eps)
        return block + self.mlp(gate_input, up_input)


class DraftStack:
    """The trained part of a drafter: fc, hidden_norm, the draft layers and the final norm, run on a
    block that is already embedded. A mixin of an nn.Module (`DFlashDrafter` here, the exported
    `DFlashDraftModel` on the serving side), so that the weights have the same names in both."""

    cfg: DrafterConfig

    def init_draft_stack(self, cfg: DrafterConfig) -> None:
        self.cfg = cfg
        self.fc = nn.Linear(cfg.num_target_features * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def compile_regions(self, compiled: bool) -> None:
        """Run the layers' elementwise work under torch.compile (`compiled_regions`) or as written."""
        regions = compiled_regions() if compiled else EAGER
        for module in self.modules():
            if isinstance(module, RMSNorm | DraftMLP):
                module.regions = regions

    @property
    def inv_freq(self) -> torch.Tensor:
        """The RoPE frequencies the layers use (compare with the target's `rotary_emb.inv_freq`)."""
        return rope_inv_freq(self.cfg.head_dim, self.cfg.rope_theta, self.fc.weight.device)

    def draft_hidden(self, context_features: torch.Tensor, context_positions: torch.Tensor,
                     block: torch.Tensor, block_positions: torch.Tensor,
                     attention_mask: torch.Tensor | BlockMask | None) -> torch.Tensor:
        """Hidden states `[Q, H]` of the embedded block `[Q, H]`, after the final norm.

        Under `torch.autocast` (bf16 compute over fp32 master weights) the context and RoPE are in
        the autocast dtype; the block's residual stream stays in the weights' dtype."""
        dtype = self.fc.weight.dtype
        device_type = self.fc.weight.device.type
        compute = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else dtype
        context = self.hidden_norm(self.fc(context_features.to(compute)))
        block = block.to(dtype)
        head_dim, theta = self.cfg.head_dim, self.cfg.rope_theta
        kv_positions = torch.cat([context_positions, block_positions])
        rope_q = rope_cos_sin(block_positions, head_dim, theta, compute)
        rope_kv = rope_cos_sin(kv_positions, head_dim, theta, compute)
        masks = {None: attention_mask}  # per sliding window: built once, shared by its layers
        for i, layer in enumerate(self.layers):
            window = self.cfg.layer_window(i)
            if window not in masks:
                masks[window] = windowed(attention_mask, window, block_positions, kv_positions)
            block = layer(block, context, rope_q, rope_kv, masks[window])
        return self.norm(block)


class DFlashDrafter(DraftStack, nn.Module):
    """Draft layers + fc + norms (trained) around the target's embedding and lm_head (frozen)."""

    def __init__(self, cfg: DrafterConfig, embed_tokens: nn.Embedding, lm_head: nn.Linear):
        super().__init__()
        if embed_tokens.weight.shape != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(f"embedding {tuple(embed_tokens.weight.shape)} does not match "
                             f"vocab {cfg.vocab_size} x hidden {cfg.hidden_size}")
        self.init_draft_stack(cfg)
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head
        self.embed_tokens.requires_grad_(False)
        self.lm_head.requires_grad_(False)

    def forward(self, context_features: torch.Tensor, context_positions: torch.Tensor,
                block_input_ids: torch.Tensor, block_positions: torch.Tensor,
                attention_mask: torch.Tensor | BlockMask | None) -> torch.Tensor:
        """Hidden states `[Q, H]` of the block tokens `[Q]`, after the final norm (`draft_hidden`)."""
        return self.draft_hidden(context_features, context_positions, self.embed_tokens(block_input_ids),
                                 block_positions, attention_mask)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden.to(self.lm_head.weight.dtype))

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights a checkpoint holds: everything but the target's frozen embedding and lm_head."""
        return {name: p.detach() for name, p in self.named_parameters() if p.requires_grad}

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        expected = set(self.trainable_state_dict())
        if set(state) != expected:
            missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
            raise ValueError(f"drafter weights do not match the model: missing {missing}, unexpected {extra}")
        self.load_state_dict(state, strict=False)
