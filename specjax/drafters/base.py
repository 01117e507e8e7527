"""Drafters: what proposes the tokens a speculative step verifies.

A drafter is static config (a frozen, hashable dataclass, part of
SpecConfig and so a jit static argument), parsed from one spec string by
drafters/registry.py (`model`, `ngram[:A-B]`, `layerskip:N`, `layerskip:LIST`,
`eagle[:PATH]`, `eagle3[:PATH]`, `streaming:W[,S]`). The loops call `init`
on the host, then, traced in the jitted step, `propose` (a chain) or
`propose_tree` (a token tree) and `commit`; what differs between drafters
is a property of the class (`deterministic`, `needs_draft_model`,
`needs_features`, `feature_layers`, `gamma_free_state`, `catches_up`,
`can_graft`, `own_params`). A drafter
that runs a network is a feeder (drafters/network.py). The drafters and
their caches: docs/drafters.md; a new one: ARCHITECTURE.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from specjax.model import kv_cache as kvc
from specjax.model import steps
from specjax.model.config import ModelConfig
from specjax.errors import ConfigError


@struct.dataclass
class Drafted:
  """What the draft phase proposes."""
  tokens: jax.Array     # [B, gamma] (any id past n_drafted; never accepted)
  q: jax.Array          # [B, gamma, V] draft distributions ([B, gamma, 0] unless needs_q)
  n_drafted: jax.Array  # [B] tokens really drafted (< gamma after an early stop or no match)
  caught_up: jax.Array  # [B] bool: the row's d_gamma of the last step was fed first


@struct.dataclass
class DraftedTree:
  """What the draft phase proposes for a token tree (sc.tree). A static
  tree's topology is sc.tree's; a dynamic tree (model.tree.DynamicTree)
  carries its own per row."""
  tokens: jax.Array     # [B, N] the nodes' tokens, BFS order (block index = node + 1)
  q: jax.Array          # [B, 1+N, V] q[:, j]: what block j's children were drawn from
                        # ([B, 1+N, 0] unless needs_q)
  caught_up: jax.Array  # [B] bool: the last step's deepest accepted node was fed first
  parents: Any = None   # [B, N] per-row parents (-1: the root), None: sc.tree's
  mask: Any = None      # [B, 1+N, 1+N] per-row tree mask, None: sc.tree.mask()
  fed: Any = None       # [B, 1+N] each block's slot in the draft's own scratch layout
                        # (-1: never fed), None: the block's own index where its depth
                        # is below the tree's (walkers.static_tree's layout)
  drafted: Any = None   # [B, N] bool: nodes really drafted (others never tried), None: all

  @property
  def n_drafted(self) -> jax.Array:
    """[B] nodes drafted: those `drafted` marks (an n-gram tree's matched
    nodes), else every node of the tree."""
    if self.drafted is None:
      return jnp.full(self.tokens.shape[:1], self.tokens.shape[1], jnp.int32)
    return jnp.sum(self.drafted, -1, dtype=jnp.int32)


@struct.dataclass
class Committed:
  """What a chain step kept, as a drafter's commit sees it (live rows; a
  finished row's fields say it kept nothing: n == n_prev, kept == 0)."""
  n_prev: jax.Array    # [B] sequence length before the step
  n: jax.Array         # [B] sequence length after it (prompt + kept tokens)
  n_acc: jax.Array     # [B] drafts accepted
  emitted: jax.Array   # [B, gamma+1] d_1..d_k, the target's token; the first `kept` are kept
  kept: jax.Array      # [B] tokens kept (n_acc + 1, less what n_predict / EOS cut off)
  live: jax.Array      # [B] bool: the row was live during the step
  d_len: jax.Array     # [B] a gamma-step draft cache's length after the step (catch-up rule)
  features: Any = None  # [B, gamma+1, E] target hidden states at [last, d_1..d_gamma]
                        # (needs_features; [B, gamma+1, len * E] with feature_layers),
                        # else None

  def roll(self, dcache: kvc.KVCache) -> kvc.KVCache:
    """A draft cache after the step: d_len, cut to what was kept."""
    return kvc.rollback(dcache, jnp.minimum(self.d_len, self.n - 1))


@struct.dataclass
class TreeCommitted(Committed):
  """What a tree step kept: the chain's, with the accepted path."""
  path: jax.Array = None        # [B, D] block indices of the accepted nodes
  draft_path: jax.Array = None  # [B, D] their slots in the draft's layout (-1: never fed)

  def roll(self, dcache: kvc.KVCache) -> kvc.KVCache:
    """The draft's block sits in scratch slots (lengths n_prev - 1): the
    accepted path's fed nodes move into place, up to the chain's length."""
    length = jnp.minimum(self.d_len, self.n - 1)
    return kvc.commit_path(dcache, self.draft_path, length - self.n_prev)


@dataclasses.dataclass(frozen=True)
class Drafter:
  """The interface (see the module docstring); subclasses are static config."""
  kind: ClassVar[str] = ""
  deterministic: ClassVar[bool] = False
  needs_draft_model: ClassVar[bool] = False
  needs_features: ClassVar[bool] = False
  # the state's shapes do not depend on the step's shape (gamma, tree), so
  # steps of different candidates continue each other (an auto run's
  # requirement); a state carrying one step's output is as wide as the
  # run's widest step (SpecConfig.carried: the EAGLE heads' pending pairs)
  gamma_free_state: ClassVar[bool] = True
  # pays a catch-up draft forward after a fully accepted step (Drafted.caught_up)
  catches_up: ClassVar[bool] = False
  # drafts a dynamic tree with a prompt-lookup chain grafted on (`+ngram:L`)
  can_graft: ClassVar[bool] = False
  # may propose no token for a row (n_drafted 0: a lookup with no match), so
  # a step where no row drafted is a decode step (chain_step.skipping_verify)
  may_draft_nothing: ClassVar[bool] = False
  # a proposal reads the batch's shared target cache, so its cost grows with
  # the batch: its probe runs at the point's batch (probes.draft_probe)
  reads_batch_cache: ClassVar[bool] = False
  # proposes gamma tokens for every row whatever it drafts (without p_min),
  # and can stop drafting at a traced depth (propose's `depth`): per-row
  # lengths allot first and draft only as deep as the longest (rows_step.py)
  drafts_to_depth: ClassVar[bool] = False

  @property
  def spec(self) -> str:
    """The canonical spec string (parse(d.spec) == d)."""
    return self.kind

  def __str__(self) -> str:
    return self.spec

  def draft_config(self, target: ModelConfig, draft: ModelConfig | None) -> ModelConfig | None:
    raise NotImplementedError

  def draft_params(self, tparams, draft: steps.Runner | None):
    raise NotImplementedError

  def for_target(self, target: ModelConfig) -> "Drafter":
    """This drafter for `target` (a spec that leaves a choice to the target,
    like a bare 'eagle', names it here; SpecConfig calls it)."""
    del target
    return self

  def own_params(self, dparams) -> int:
    """Parameters of its own (what it only reads of the target's is not counted)."""
    return 0

  @property
  def feature_layers(self) -> tuple[int, ...] | None:
    """The target layers whose outputs a drafter that `needs_features` reads,
    concatenated (llama.forward's hidden_layers; EAGLE-3's low, middle and
    high); None: the final-normed hidden state (EAGLE-1)."""
    return None

  def init(self, sc, target: steps.Runner, dparams, prompts, capacity: int, first):
    raise NotImplementedError

  def propose(self, dparams, dstate, tcache: kvc.KVCache, tail, n, live, key, sc, depth=None):
    """(Drafted, dstate, tcache); `depth` (traced, only if drafts_to_depth):
    drafts past it are not drafted, and are junk."""
    raise NotImplementedError

  def commit(self, dstate, c: Committed):
    raise NotImplementedError

  def settle(self, dparams, dstate, n, sc):
    """The state before a run of tails-only steps (SpecConfig.tails_only),
    cut to what one such step leaves: an EAGLE head's pending pairs fed and
    the root's kept (Pending.settled). A drafter that carries no step's output
    has nothing to cut."""
    del dparams, n, sc
    return dstate

  def check_tree(self, tree) -> None:
    """Refuses (ConfigError, one line) a token tree this drafter cannot draft;
    checked with the flags (plan.parse_flags), before any model runs. A
    drafter without its own propose_tree drafts none; one with it drafts
    static and dynamic trees unless it says otherwise."""
    if type(self).propose_tree is Drafter.propose_tree:
      raise ConfigError(f"drafter {self.spec} cannot draft a token tree (--tree={tree.spec}); "
                        "use --tree=chain")

  def propose_tree(self, dparams, dstate, tcache: kvc.KVCache, tail, n, live, key, sc):
    """propose for a token tree (sc.tree): (DraftedTree, dstate, tcache)."""
    raise ConfigError(f"drafter {self.spec} cannot draft a token tree (--tree); "
                      f"use --tree=chain")
