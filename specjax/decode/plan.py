"""A run's configuration, resolved once at the edge.

`resolve` turns the flags (drafter, gamma, accept rule, tree, siblings,
sampling, p_min) into a `Plan`: the validated `SpecConfig` of every
candidate the run may step with (one for a fixed run or --gamma=auto:rows;
one per gamma of the set for --gamma=auto, one per candidate tree for --tree=auto: auto is a run
mode, not a tree type) and the accept rule. The engine takes a Plan and
never parses a flag string again. SpecConfig is the jit key; its `step`
(chain_step.ChainStep or tree_step.TreeStep) is chosen here, once, and its
`block` is the one formula for the slots a step writes past the cache's
length (the capacity: prompt + n_predict + block - 1).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np

from specjax.decode import acceptance
from specjax.decode import chain_step
from specjax.decode import generation
from specjax.decode import rows_step
from specjax.decode import tree_step
from specjax.decode.acceptance import AcceptRule
from specjax.drafters import registry
from specjax.drafters.base import Drafter
from specjax.drafters.draft_model import MODEL
from specjax.errors import ConfigError
from specjax.metrics import tree_theory
from specjax.model import tree as trees
from specjax.model.config import ModelConfig
from specjax.model.sampling import SamplingParams

AUTO = "auto"
AUTO_SET = (1, 2, 4, 8)          # --gamma=auto's gammas unless given
AUTO_SIZES = (4, 8, 16, 32, 64)  # --tree=auto's candidate tree sizes unless given
AUTO_DEPTH = 8                   # --tree=auto's depth bound
AUTO_CHAINS = (1, 2, 4, 8)       # --tree=auto's chains
ROWS = "rows"                    # --gamma=auto:rows: per-row lengths (rows_step.py)
ROWS_MAX = 8                     # its longest draft a row may get unless given


@dataclasses.dataclass(frozen=True)
class SpecConfig:
  """Static settings of one speculative step (a jit static argument).

  `draft` is the config of the model the drafter runs (set here by the
  drafter: the draft model's, the target's layer subset, the EAGLE head's
  layer, None for ngram). `tree` None is the chain of `gamma` drafts;
  otherwise a static or dynamic tree and gamma its depth."""
  target: ModelConfig
  draft: ModelConfig | None
  gamma: int
  sp: SamplingParams = SamplingParams()
  simulated: bool = False  # a simulated rule; its per-position probabilities are traced
  p_min: float = 0.0    # draft early stop: stop when the draft's top prob < p_min
  drafter: Drafter = MODEL
  tree: trees.Tree | trees.DynamicTree | None = None
  siblings: str = "topk"    # a tree's siblings: the draft's top-k, or i.i.d. draws from q
  carry: int = 0  # the run's `carried` width (an auto run's widest candidate's); 0: gamma + 1
  per_row: bool = False  # --gamma=auto:rows: gamma is gamma_max, each row verifies its share
  budget: int = 0  # per_row's verify budget N (tokens per step); 0: rows_step.default_budget

  def __post_init__(self):
    if self.gamma < 1:
      raise ConfigError(f"gamma (draft length) must be >= 1, got {self.gamma}")
    if self.carry and self.carry < self.gamma + 1:
      raise ConfigError(f"carry {self.carry} is narrower than a gamma-{self.gamma} step's "
                        f"{self.gamma + 1} emitted tokens")
    if not 0.0 <= self.p_min <= 1.0:
      raise ConfigError(f"p_min must lie in [0, 1], got {self.p_min}")
    if self.siblings not in ("topk", "stochastic"):
      raise ConfigError(f"siblings must be 'topk' or 'stochastic', got {self.siblings!r}")
    if self.per_row and self.tree is not None:
      raise ConfigError("--gamma=auto:rows gives each row of a chain its length: use "
                        "--tree=chain")
    if self.budget < 0 or (self.budget and not self.per_row):
      raise ConfigError(f"a verify budget ({self.budget}) is per-row lengths' (--gamma=auto:rows)")
    if self.tree is not None and self.gamma != self.tree.max_depth:
      raise ConfigError(f"a tree of depth {self.tree.max_depth} runs at gamma = its depth, "
                        f"got gamma {self.gamma}")
    object.__setattr__(self, "drafter", registry.parse(self.drafter).for_target(self.target))
    check_shape(self.drafter, self.tree, self.p_min)
    object.__setattr__(self, "draft", self.drafter.draft_config(self.target, self.draft))
    if self.draft is not None:
      check_vocabularies(self.target, self.draft)
      if self.draft.attention == "auto":  # a head read from its file: the target's kind,
        object.__setattr__(self, "draft",  # resolved for the backend at load
                           self.draft.replace(attention=self.target.attention))

  @property
  def step(self):
    """The step's phases: chain_step.CHAIN, rows_step.ROWS or tree_step.TREE."""
    if self.per_row:
      return rows_step.ROWS
    return chain_step.CHAIN if self.tree is None else tree_step.TREE

  @property
  def needs_q(self) -> bool:
    """Only exact sampling reads the draft distributions q (a deterministic
    drafter's q is onehot(x), never materialised)."""
    return (not self.simulated and not self.sp.greedy and not self.drafter.deterministic
            and (self.tree is None or self.siblings == "stochastic"))

  @property
  def carried(self) -> int:
    """The width of what a drafter's state carries from one step to the next
    (an EAGLE head's pending pairs: the emitted tokens and their features,
    padded): gamma + 1 (a tree's: its depth + 1), or in an auto run the
    widest candidate's (`carry`, set by the plan), so that steps of every
    candidate continue one state."""
    return self.carry or self.gamma + 1

  def tails_only(self, batch: int) -> bool:
    """Every step verifies each row's tail alone (per-row lengths at budget
    N = B): a step keeps one token a row, so a drafter's state carries one
    pending pair into the next (`refresh_pairs`)."""
    return self.per_row and rows_step.budget_of(self, batch) == batch

  def refresh_pairs(self, batch: int) -> int:
    """The pending pairs a head's step feeds first (eagle.refresh): the
    `carried` width, or 1 in a tails-only run, whose state enters each chunk
    with one (Drafter.settle). The padding cost 6.7 ms a step against 3.2-3.7
    for one pair (SmolLM2's EAGLE-3 head at batch 16, gamma_max 4).
    docs/packed_verify.md (the head's step at N = B)."""
    return 1 if self.tails_only(batch) else self.carried

  @property
  def block(self) -> int:
    """Slots one step writes past the cache's length: gamma + 1, or the
    larger of a tree's verify block and its draft's feed layout (and of the
    `carried` pairs a head refreshes from the length)."""
    if self.tree is None:
      return max(self.gamma + 1, self.carried)
    return max(self.tree.block_size, self.tree.fed_slots, self.carried)


def check_shape(drafter: Drafter, tree, p_min: float) -> None:
  """The drafter can draft the shape (None: the chain) with these settings."""
  if tree is None:
    return
  if p_min > 0:
    raise ConfigError("p_min (draft early stop) is for chains; a tree drafts every node")
  drafter.check_tree(tree)
  if tree.graft and not drafter.can_graft:
    raise ConfigError(f"--tree={tree.spec} grafts a prompt-lookup chain onto an EAGLE head's "
                      f"tree; drafter {drafter.spec} cannot (use --drafter=eagle[:PATH])")


def check_vocabularies(target: ModelConfig, draft: ModelConfig) -> None:
  """Speculative decoding compares token ids: the two vocabularies must match."""
  if target.vocab_size != draft.vocab_size:
    raise ConfigError(
        f"draft and target vocabularies differ: target {target.name} has "
        f"{target.vocab_size} tokens, draft {draft.name} has {draft.vocab_size}")


@dataclasses.dataclass(frozen=True)
class Plan:
  """A run's resolved configuration: its candidates (name -> SpecConfig; one
  for a fixed run) and the accept rule. `auto` is '', 'gamma', 'tree' or
  'rows' (--gamma=auto:rows,budget=auto: one candidate per budget)."""
  configs: Mapping[str, SpecConfig]
  rule: AcceptRule
  auto: str = ""

  @property
  def sc(self) -> SpecConfig:
    """A fixed run's one config."""
    if len(self.configs) != 1:
      raise ConfigError(f"a run with {len(self.configs)} candidates has no single config")
    return next(iter(self.configs.values()))

  @property
  def first(self) -> SpecConfig:
    return next(iter(self.configs.values()))

  @property
  def drafter(self) -> Drafter:
    return self.first.drafter

  @property
  def widest(self) -> SpecConfig:
    """The candidate whose step writes the most slots (its drafter state is
    the run's: every candidate's steps continue it)."""
    return max(self.configs.values(), key=lambda c: (c.block, c.gamma))

  @property
  def block(self) -> int:
    return max(c.block for c in self.configs.values())

  @property
  def deepest(self) -> int:
    """The most tokens one step emits, less one: the output buffer's margin."""
    return max(c.gamma for c in self.configs.values())

  def accept_probs(self, name: str | None = None) -> np.ndarray:
    """A candidate's traced acceptance table (unused by the real rule)."""
    sc = self.sc if name is None else self.configs[name]
    return np.asarray(sc.step.accept_table(self.rule.resolve(sc.gamma), sc))

  def capacity(self, prompt_len: int, n_predict: int, ctx_size: int | None = None,
               capacity: int | None = None) -> int:
    """Cache slots for the run: prompt + n_predict + block - 1 (checked)."""
    return generation.plan_capacity(self.first.target, prompt_len, n_predict,
                                    extra=self.block - 1, ctx_size=ctx_size, capacity=capacity)


def candidate_trees(sizes: Sequence[int] = AUTO_SIZES, max_depth: int = AUTO_DEPTH,
                    p: Sequence[float] = tree_theory.PRIOR_P,
                    chains: Sequence[int] = AUTO_CHAINS) -> dict[str, trees.Tree]:
  """--tree=auto's candidates, name -> Tree: the chains 'chain:g' (g <=
  max_depth) and Sequoia's best trees 'sequoia:n,d' of each size at the
  positional acceptance p, a tree repeating an earlier topology dropped."""
  chains = [g for g in chains if g <= max_depth]
  out, seen = {}, set()
  for name, paths in tree_theory.candidates(p, sizes, max_depth, chains).items():
    if paths in seen:
      continue
    seen.add(paths)
    out[name] = trees.chain(len(paths)) if name.startswith("chain:") else trees.from_paths(
        paths, name)
  return out


def parse_auto_sizes(spec: str) -> tuple[int, ...] | None:
  """'auto' -> AUTO_SIZES, 'auto:8,16' -> (8, 16), anything else -> None."""
  head, colon, body = str(spec).strip().partition(":")
  if head != AUTO:
    return None
  if not colon:
    return AUTO_SIZES
  try:
    sizes = tuple(sorted({int(x) for x in body.split(",")}))
  except ValueError:
    raise ConfigError(f"--tree={spec}: expected auto or auto:N1,N2,.. (tree sizes)") from None
  if not sizes or min(sizes) < 1:
    raise ConfigError(f"--tree={spec}: sizes must be >= 1")
  return sizes


def parse_rows(spec: str) -> tuple[int, int | str] | None:
  """'auto:rows[,max=G][,budget=N|auto]' -> (gamma_max, budget; 0: the
  default for the batch; 'auto': chosen between chunks, autorows.py);
  anything not starting 'auto:rows' -> None."""
  head, _, body = str(spec).strip().lower().partition(",")
  if head.replace(" ", "") != f"{AUTO}:{ROWS}":
    return None
  usage = (f"--gamma={spec}: expected auto:rows[,max=G][,budget=N|auto] (G: the longest "
           "draft a row may get, 1 to 64; N: tokens verified per step, >= the batch; auto: "
           "chosen at run time)")
  got = {"max": ROWS_MAX, "budget": 0}
  for item in filter(None, body.replace(" ", "").split(",")):
    key, eq, value = item.partition("=")
    if key == "budget" and value == AUTO:
      got[key] = AUTO
      continue
    if key not in got or not eq or not value.isdigit():
      raise ConfigError(usage)
    got[key] = int(value)
  if not 1 <= got["max"] <= 64 or (body and "budget=" in body and got["budget"] != AUTO
                                   and got["budget"] < 1):
    raise ConfigError(usage)
  return got["max"], got["budget"]


def candidate_budgets(batch: int, gamma_max: int) -> tuple[int, ...]:
  """budget=auto's candidates: the tails plus 0, 1/2, 1, 2, 4 and G drafts a
  row on average (N = B + ceil(e B), at most B (G + 1)), distinct."""
  shares = (0.0, 0.5, 1.0, 2.0, 4.0, float(gamma_max))
  return tuple(sorted({batch + min(math.ceil(e * batch), batch * gamma_max) for e in shares}))


def parse_gamma_set(spec: str | Sequence[int]) -> tuple[int, ...]:
  """'1,2,4,8' (or a sequence) -> sorted distinct gammas in [1, 64]."""
  if isinstance(spec, str):
    try:
      items = [int(x) for x in spec.replace(" ", "").split(",") if x]
    except ValueError:
      raise ConfigError(f"the auto gamma set must be comma-separated integers, got {spec!r}") \
          from None
  else:
    items = [int(x) for x in spec]
  if not items:
    raise ConfigError("the auto gamma set is empty: give e.g. 1,2,4,8")
  if min(items) < 1 or max(items) > 64:
    raise ConfigError(f"the auto gamma set must hold gammas in [1, 64], got {items}")
  return tuple(sorted(set(items)))


def _shape(tree, gamma: int):
  """A tree spec or object -> (gamma, None for the chain or the tree)."""
  if tree is None or (isinstance(tree, str) and tree.strip() == "chain"):
    return gamma, None
  t = trees.parse(tree, gamma) if isinstance(tree, str) else tree
  if isinstance(tree, str) and tree.strip().startswith("chain:"):
    return t.max_depth, None  # chain:G is the chain of G drafts
  return t.max_depth, t


@dataclasses.dataclass(frozen=True)
class RunFlags:
  """A run's flags, parsed and checked (`parse_flags`) before any model
  loads; `resolve` adds the models' configs and makes the Plan."""
  drafter: Drafter
  rule: AcceptRule
  candidates: Mapping[str, tuple[int, object]]  # name -> (gamma, tree or None: the chain)
  auto: str = ""
  siblings: str = "topk"
  sp: SamplingParams = SamplingParams()
  p_min: float = 0.0
  budget: int | str | None = None  # --gamma=auto:rows: the verify budget (0: the
                                   # default; 'auto': candidate_budgets, chosen at run time)

  def resolve(self, target: ModelConfig, draft: ModelConfig | None,
              batch: int | None = None) -> Plan:
    """The Plan; `batch` (the rows) is needed by budget=auto, whose candidate
    budgets are counted in tokens per step."""
    if self.budget == AUTO:
      if batch is None:
        raise ConfigError("--gamma=auto:rows,budget=auto needs the batch to choose budgets for")
      (g, _), = self.candidates.values()
      return Plan({f"{ROWS}:{g},N={n}": SpecConfig(
          target, draft, g, self.sp, self.rule.simulated, self.p_min, self.drafter,
          siblings=self.siblings, per_row=True, budget=n) for n in candidate_budgets(batch, g)},
                  self.rule, ROWS)
    # an auto run's candidates carry the widest one's state (SpecConfig.carried)
    carry = max(g for g, _ in self.candidates.values()) + 1 if self.auto else 0
    rows = dict(per_row=True, budget=self.budget) if self.budget is not None else {}
    configs = {k: SpecConfig(target, draft, g, self.sp, self.rule.simulated, self.p_min,
                             self.drafter, t, self.siblings, carry, **rows)
               for k, (g, t) in self.candidates.items()}
    return Plan(configs, self.rule, self.auto)


def parse_flags(*, drafter: Drafter | str = "model", gamma: int | str = 4,
                rule: AcceptRule | str = "real", tree=None, siblings: str = "topk",
                sp: SamplingParams = SamplingParams(), p_min: float = 0.0,
                auto_set: str | Sequence[int] = AUTO_SET,
                auto_trees: Mapping[str, object] | None = None,
                prior_p: Sequence[float] = tree_theory.PRIOR_P) -> RunFlags:
  """The flags (module docstring) -> RunFlags; ConfigError, one line, for any
  bad value or combination. gamma: an int, 'auto' (choose from
  `auto_set`) or 'auto:rows[,max=G][,budget=N]' (per-row lengths); tree: None / 'chain', any --tree spec or a Tree /
  DynamicTree, 'auto' or 'auto:N1,..' (choose among candidate_trees, or
  `auto_trees`: name -> spec or Tree)."""
  drafter = registry.parse(drafter)
  rule = acceptance.parse_rule(rule) if isinstance(rule, str) else rule
  sizes = parse_auto_sizes(tree) if isinstance(tree, str) else None
  rows = parse_rows(gamma)
  if rows is not None:
    if sizes is not None or auto_trees is not None or _shape(tree, 1)[1] is not None:
      raise ConfigError("--gamma=auto:rows gives each row of a chain its length: use "
                        "--tree=chain")
    rule.resolve(rows[0])
    return RunFlags(drafter, rule, {f"{ROWS}:{rows[0]}": (rows[0], None)},
                    ROWS if rows[1] == AUTO else "", siblings, sp, p_min, budget=rows[1])
  if siblings not in ("topk", "stochastic"):
    raise ConfigError(f"siblings must be 'topk' or 'stochastic', got {siblings!r}")
  if str(gamma).strip().lower() == AUTO:
    if sizes is not None or auto_trees is not None or _shape(tree, 1)[1] is not None:
      raise ConfigError("--gamma=auto chooses a chain's length: use --tree=chain (or "
                        "--tree=auto with a fixed --gamma)")
    cands = {f"chain:{g}": (g, None) for g in parse_gamma_set(auto_set)}
    auto = "gamma"
  elif sizes is not None or auto_trees is not None:
    shapes = (candidate_trees(sizes, p=prior_p) if auto_trees is None else
              {k: _shape(v, int(gamma))[1] or trees.chain(_shape(v, int(gamma))[0])
               for k, v in auto_trees.items()})
    if not shapes:
      raise ConfigError("--tree=auto needs at least one candidate tree")
    cands = {k: (t.max_depth, None if t.is_chain else t) for k, t in shapes.items()}
    auto = "tree"
  else:
    g, t = _shape(tree, int(gamma))
    cands, auto = {t.spec if t is not None else f"chain:{g}": (g, t)}, ""
  for g, t in cands.values():
    rule.resolve(g)
    check_shape(drafter, t, p_min)
  if auto:
    if p_min:
      raise ConfigError(f"--{'gamma' if auto == 'gamma' else 'tree'}=auto runs the device loop "
                        "in chunks: no --p_min")
    check_auto_drafter(drafter, len(cands))
  return RunFlags(drafter, rule, cands, auto, siblings, sp, p_min)


def resolve(target: ModelConfig, draft: ModelConfig | None, **flags) -> Plan:
  """parse_flags(**flags).resolve(target, draft): the run's Plan."""
  return parse_flags(**flags).resolve(target, draft)


def check_auto_drafter(drafter: Drafter, n_candidates: int) -> None:
  """Candidates that switch between chunks continue one drafter state."""
  if n_candidates > 1 and not drafter.gamma_free_state:
    raise ConfigError(f"drafter {drafter.spec} keeps state shaped by gamma: the draft shape "
                      "cannot be chosen at run time (use model, ngram or layerskip)")
