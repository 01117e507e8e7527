"""The sweeps' grids: a point of the gamma sweep (`Point`: drafter, batch,
gamma, rule, temperature; gamma a fixed one, auto, or per-row lengths'
auto:rows,max=G[,budget=N|auto] for each of row_budgets) and of the trees
sweep (`TreePoint`: a tree in place of the gamma), each point's key and the
key read back from its record (what a resume skips), the groups of gamma
points that share their target-only runs and probes, and the ragged rows of
a batch."""

from __future__ import annotations

import dataclasses

from specjax.bench.sweep import engine
from specjax.bench.sweep.config import AUTO, SweepConfig, row_budgets_at
from specjax.model.sampling import SamplingParams
from specjax.workdir import Record


def gamma_key(g) -> int | str:
  """A gamma as a key: an int, AUTO, or a per-row spec as written (its
  budget included: two budgets are two points)."""
  return g if isinstance(g, str) and not g.isdigit() else int(g)


@dataclasses.dataclass(frozen=True)
class Point:
  gamma: int | str  # an int, AUTO, or a per-row spec (engine.rows_spec)
  accept_rule: str
  sp: SamplingParams
  batch: int = 1
  drafter: str = "model"  # the drafter's canonical spec (drafters.Drafter.spec)

  @property
  def auto(self) -> bool:
    return self.gamma == AUTO

  @property
  def rows(self) -> bool:
    """Per-row lengths (--gamma=auto:rows..)."""
    return isinstance(self.gamma, str) and engine.parse_rows(self.gamma) is not None

  @property
  def key(self) -> tuple:
    return (self.drafter, self.batch, gamma_key(self.gamma), self.accept_rule,
            self.sp.temperature)

  @property
  def label(self) -> str:
    return f"{self.drafter} B={self.batch} g={self.gamma} {self.accept_rule} " \
           f"T={self.sp.temperature:g}"


@dataclasses.dataclass(frozen=True)
class TreePoint:
  tree: str          # a model.tree spec, or AUTO
  accept_rule: str
  sp: SamplingParams
  batch: int = 1
  drafter: str = "model"

  @property
  def auto(self) -> bool:
    return self.tree == AUTO

  @property
  def key(self) -> tuple:
    return (self.drafter, self.batch, self.tree, self.accept_rule, self.sp.temperature)

  @property
  def label(self) -> str:
    return f"{self.drafter} B={self.batch} {self.tree} {self.accept_rule} " \
           f"T={self.sp.temperature:g}"

  @property
  def kind(self) -> str:
    """auto, chain, dynamic or tree: named in the line that skips a tree a
    drafter cannot run (trees.TreesRunner.measure)."""
    return (AUTO if self.auto else "chain" if self.tree.startswith("chain")
            else "dynamic" if self.tree.startswith("dynamic") else "tree")


def point_key(rec: Record) -> tuple:
  return (str(rec.get("drafter") or "model"), int(rec.get("batch", 1)), gamma_key(rec["gamma"]),
          str(rec["accept_rule"]), float(rec["temperature"]))


def tree_point_key(rec: Record) -> tuple:
  return (str(rec.get("drafter") or "model"), int(rec.get("batch", 1)), str(rec["tree"]),
          str(rec["accept_rule"]), float(rec["temperature"]))


def gamma_points(cfg: SweepConfig, drafters: list[str]) -> list[Point]:
  """Every point of a gamma sweep, in the order it runs (a group's points
  follow one another): the fixed gammas, auto, then per-row lengths at
  gamma_max = max(gammas) for each row budget that applies at the batch."""
  gammas = sorted(cfg.gammas) + ([AUTO] if cfg.auto_gamma else [])
  rows = lambda b: [engine.rows_spec(max(cfg.gammas), n) for n in row_budgets_at(cfg, b)]
  return [Point(g, a, cfg.sampling(t), b, d) for d in drafters for b in sorted(cfg.batches)
          for t in cfg.temps for g in gammas + rows(b) for a in cfg.accepts]


def tree_points(cfg: SweepConfig, drafters: list[str]) -> list[TreePoint]:
  return [TreePoint(t, a, cfg.sampling(temp), b, d) for d in drafters
          for b in sorted(cfg.batches) for temp in cfg.temps for t in cfg.trees
          for a in cfg.accepts]


def group_key(p: Point) -> tuple:
  """Points that share a group (gamma.run_group): same drafter, batch, gamma
  and sampling settings; they differ only in the acceptance rule."""
  return (p.drafter, p.batch, p.gamma, p.sp)


def batch_prompts(prompts: list[list[int]], batch: int) -> list[list[list[int]]]:
  """The groups of rows a point at `batch` runs, one generate call each.
  Batch 1: every prompt on its own (the original sweep). Batch B > 1: one
  group of B rows; row r is prompt r mod n cut short by (r div n) mod
  ceil(L/2) tokens, so the rows have ragged lengths (and none is empty)."""
  if batch == 1:
    return [[p] for p in prompts]
  n = len(prompts)
  rows = []
  for r in range(batch):
    p = prompts[r % n]
    rows.append(p[:len(p) - (r // n) % max(1, (len(p) + 1) // 2)])
  return [rows]


def distinct_rows(prompts: list[list[int]], batches) -> list[list[int]]:
  """Every row that the points at `batches` run (batch_prompts), each once:
  what prefills.MemoRunner prefills, the cut rows of a large batch included."""
  seen = {tuple(r): r for b in batches for g in batch_prompts(prompts, b) for r in g}
  return list(seen.values())
