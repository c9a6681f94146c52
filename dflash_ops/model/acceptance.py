"""Acceptance counting, shared by training's held-out figures and serving's evaluation: what the verify
steps of one proposer gave (`AcceptanceStats`), and the tokens gained per verify step when decoding
reproduces a known text (`replay_acceptance`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AcceptanceStats:
    """What the verify steps of one proposer gave, over all prompts."""

    name: str
    block_size: int  # the verify block, drafts a step + 1: b for DFlash, b + 1 for DSpark (b drafts)
    lengths: list[int] = field(default_factory=list)  # tokens gained per verify step (1..block_size)
    generated_tokens: int = 0
    # Drafts the target accepted at each verify step, before the budget's or the end of text's cut:
    # what an engine's counters count (vLLM's accepted tokens per draft position).
    accepted: list[int] = field(default_factory=list)

    @property
    def verify_steps(self) -> int:
        return len(self.lengths)

    @property
    def tau(self) -> float:
        return sum(self.lengths) / len(self.lengths) if self.lengths else float("nan")

    def acceptance_by_position(self) -> list[float]:
        """For draft positions 1..b-1: the fraction of steps that accepted at least that many drafts."""
        steps = max(1, len(self.lengths))
        return [sum(1 for n in self.lengths if n - 1 >= k) / steps for k in range(1, self.block_size)]

    def accepted_by_position(self) -> list[int]:
        """For draft positions 1..b-1: how many steps accepted at least that many drafts, uncut."""
        return [sum(1 for n in self.accepted if n >= k) for k in range(1, self.block_size)]

    def as_dict(self) -> dict:
        return {"name": self.name, "tau": round(self.tau, 4), "verify_steps": self.verify_steps,
                "generated_tokens": self.generated_tokens,
                "acceptance_by_position": [round(r, 4) for r in self.acceptance_by_position()],
                "accepted_by_position": self.accepted_by_position()}


def replay_acceptance(tokens: list[int], start: int, drafts_at: dict[int, list[int]]) -> list[int]:
    """Tokens gained per verify step when decoding reproduces `tokens` from position `start` (the
    first generated token) to its end, with `drafts_at[a]` the drafts of anchor position a for positions
    a+1, a+2, ... (a DFlash drafter's b-1, a DSpark drafter's b)."""
    lengths = []
    anchor, last = start, len(tokens) - 1
    while anchor < last:
        drafts = drafts_at[anchor]
        accepted = 0
        while (accepted < len(drafts) and anchor + 1 + accepted <= last
               and drafts[accepted] == tokens[anchor + 1 + accepted]):
            accepted += 1
        gained = min(accepted + 1, last - anchor)
        lengths.append(gained)
        anchor += gained
    return lengths
