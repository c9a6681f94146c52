"""Who is which rank of a pipeline run, and which ranks a batch goes through.

The launcher (which imports no torch) plans its member's workers with it, and every worker finds
its own role with it, so both count the same way:

- `rank_table`: every global rank of the run, in rank order: member by member in member order,
  and within a member its drafters, then its targets; role ranks count in rank order. One member:
  drafters first, rank 0 is drafter 0. Members [1+1, 1+1]: drafter0, target0 (member 0), drafter1,
  target1 (member 1). A worker's global rank is its member's first rank (`first_rank`) plus its
  LOCAL_RANK.
- `BatchSchedule`: batch i (in the data order of a single-process run) is computed by target
  i % T and trained on by drafter i % D.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from dflash_ops.core.config import PipelineConfig

ROLES = ("drafter", "target")


class RankRow(NamedTuple):
    """One global rank of the run."""

    name: str  # drafter0, drafter1..., target0...
    role: str  # "drafter" | "target"
    role_rank: int  # index among the workers of its role, over every member
    member: int  # the member (container) it runs in


def rank_table(pipeline: PipelineConfig) -> list[RankRow]:
    """Every global rank of the run, in rank order (see the module's docstring)."""
    table: list[RankRow] = []
    counts = dict.fromkeys(ROLES, 0)
    for member, (drafters, targets) in enumerate(pipeline.member_counts):
        for role in ["drafter"] * drafters + ["target"] * targets:
            table.append(RankRow(f"{role}{counts[role]}", role, counts[role], member))
            counts[role] += 1
    return table


def first_rank(pipeline: PipelineConfig) -> int:
    """The global rank of this member's local rank 0."""
    return sum(d + t for d, t in pipeline.member_counts[:pipeline.member])


@dataclass(frozen=True)
class BatchSchedule:
    """The global ranks of each role, and where batch i goes: target i % T computes it, drafter
    i % D trains on it (D drafters: optimizer step s uses batches s*D .. s*D + D - 1)."""

    drafter_ranks: tuple[int, ...]  # global ranks of drafter 0, 1...
    target_ranks: tuple[int, ...]  # global ranks of target 0, 1...

    @classmethod
    def of(cls, table: list[RankRow]) -> BatchSchedule:
        drafters, targets = ([i for i, row in enumerate(table) if row.role == role] for role in ROLES)
        return cls(tuple(drafters), tuple(targets))

    @property
    def num_drafters(self) -> int:
        return len(self.drafter_ranks)

    @property
    def num_targets(self) -> int:
        return len(self.target_ranks)

    def target_rank(self, batch_index: int) -> int:
        """Global rank of the target worker that computes batch `batch_index`."""
        return self.target_ranks[batch_index % self.num_targets]

    def drafter_role_rank(self, batch_index: int) -> int:
        """Role rank of the drafter that trains on batch `batch_index`."""
        return batch_index % self.num_drafters

    def drafter_batches(self, role_rank: int, first: int, end: int) -> list[int]:
        """The batches in [first, end) that drafter `role_rank` trains on, in order."""
        return [i for i in range(first, end) if self.drafter_role_rank(i) == role_rank]

    def target_batches(self, rank: int, first: int, end: int) -> list[int]:
        """The batches in [first, end) that the target of global rank `rank` computes, in order."""
        return [i for i in range(first, end) if self.target_rank(i) == rank]


def member_leader(table: list[RankRow], rank: int) -> bool:
    """Whether global rank `rank` is its member's first drafter (it logs the run's steps and writes
    the member's checkpoints)."""
    row = table[rank]
    return row.role == "drafter" and rank == min(
        i for i, other in enumerate(table) if other.role == "drafter" and other.member == row.member)
