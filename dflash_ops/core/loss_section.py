"""The training config's `loss` section: what the drafter's block positions are trained against.

`kind`: `ce` (the hard label, the token the target generated: DFlash's loss), `kl` (forward KL from the
target's distribution), `tvd` (the L1 distance to it, Model-Optimizer's TVD term) or `mix`, a weighted
sum of them given by `weights` (Model-Optimizer's DSpark default: {ce: 0.1, tvd: 0.9}). Each kind but
`ce` makes the target ranks send their last hidden state too (`dflash_ops.model.distill`). The weighting
of block positions (optim.loss_weighting: decay or D-PACE) applies to whichever kind.
No torch here: `dflash_ops.core.config` loads it.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_ops.core.sections import Section

LOSS_TERMS = ("ce", "kl", "tvd", "bce")  # bce: DSpark's confidence head (model.kind dspark)
LOSS_KINDS = ("ce", "kl", "tvd", "mix")


def loss_mix(kind: str, weights: dict | None = None) -> dict[str, float]:
    """The terms and their weights of `loss.kind` (`mix`: `weights`, e.g. {"ce": 0.1, "tvd": 0.9}, the
    terms of weight 0 left out). ValueError on an unknown kind or term, weights with another kind than
    mix, a negative weight, or no positive one."""
    if kind not in LOSS_KINDS:
        raise ValueError(f"loss.kind {kind!r}: expected one of {', '.join(LOSS_KINDS)}")
    if kind != "mix":
        if weights:
            raise ValueError(f"loss.weights apply to loss.kind mix only, got kind {kind!r}")
        return {kind: 1.0}
    weights = dict(weights or {})
    unknown = sorted(map(str, set(weights) - set(LOSS_TERMS)))
    if unknown or not weights:
        raise ValueError(f"loss.weights {weights}: expected weights of {', '.join(LOSS_TERMS)}")
    values = list(weights.values())
    if not all(isinstance(w, int | float) and not isinstance(w, bool) for w in values):
        raise ValueError(f"loss.weights {weights}: expected numbers")
    if any(w < 0 for w in values) or not any(w > 0 for w in values):
        raise ValueError(f"loss.weights {weights}: must be >= 0 with one of them > 0")
    return {term: float(w) for term, w in weights.items() if w > 0}


def needs_target(mix: dict[str, float]) -> bool:
    """Whether the mix needs the target's distribution (any term but ce: bce's label is 1 - TVD/2)."""
    return any(term != "ce" for term in mix)


def capture_layer_ids(layer_ids: list[int], n_target_layers: int, mix: dict[str, float]) -> list[int]:
    """The target layers the target ranks (and a feature cache) capture: the drafter's `layer_ids`, then,
    when the mix needs the target's distribution, the last layer (captured after the final norm:
    `dflash_ops.data.target._layer_capture`), whose output is the target's last hidden state."""
    return [*layer_ids, n_target_layers - 1] if needs_target(mix) else list(layer_ids)


def extra_head_flops(mix: dict[str, float], dspark_rank: int | None, anchors: int, block_size: int,
                     hidden: int, vocab: int) -> float:
    """A drafter's FLOPs a sample beyond DFlash's cross entropy (`dflash_ops.run.balance.drafter_flops`):
    the target's logits of every scored row when the mix needs them (one more head forward); for DSpark
    (`dspark_rank`: its Markov rank) one more scored row a block (position 0 drafts too), the Markov bias
    forward and backward, and the head's forward twice more (recomputed under activation checkpointing,
    and the corrected argmax)."""
    head = 2.0 * hidden * vocab
    if dspark_rank is None:
        return anchors * (block_size - 1) * head if needs_target(mix) else 0.0
    scored = anchors * block_size
    dspark = scored * (3.0 * 2.0 * dspark_rank * vocab + 2.0 * head) + anchors * 3.0 * head
    return dspark + (scored * head if needs_target(mix) else 0.0)


@dataclass
class LossConfig(Section):
    kind: str = "ce"
    weights: dict | None = None  # with kind mix: {ce: w, kl: w, tvd: w, bce: w} (the terms it names)
    _name = "loss"

    def __post_init__(self) -> None:
        self._check_types()
        try:
            loss_mix(self.kind, self.weights)
        except ValueError as exc:
            key = "kind" if self.kind not in LOSS_KINDS else "weights"
            self._require(False, key, str(exc).split(": ", 1)[-1] if key == "weights" else
                          f"must be one of {', '.join(LOSS_KINDS)}")

    @property
    def mix(self) -> dict[str, float]:
        return loss_mix(self.kind, self.weights)
