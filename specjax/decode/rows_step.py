"""Per-row draft lengths (--gamma=auto:rows): a chain step whose verify is one
packed block of N tokens (model/packed.py), each row given its own length.

`RowsStep.allot` gives row b a length l_b (allocation.allocate: the top
N - B gains alpha_b^k, at most what the row proposed, 0 for a finished row)
and caps Drafted.n_drafted there; a network drafter, which always proposes
gamma_max, is allotted first and drafts only as deep as the longest l_b
(`RowsStep.draft`). The verify packs each row's 1 + l_b tokens
(steps.packed_verify) and brings the logits (and an EAGLE head's features)
back to [B, gamma_max + 1]; the judge is the chain's, stopped at l_b.
alpha_b is a running estimate (`RowAlpha`, in the loop state) from the
row's own past accepted counts, and, where a proposal is a point mass, from
rows given nothing too (`free_test`). Exactness: a length depends on past
acceptances and on how many tokens were proposed, never on their values.
docs/packed_verify.md (per-row lengths).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from specjax.decode import allocation
from specjax.decode import chain_step
from specjax.drafters.base import Drafted
from specjax.model import packed as pk
from specjax.model import sampling
from specjax.model import steps

PRIOR_ALPHA = 0.7   # as autogamma's: pseudo-observations at this alpha ..
PRIOR_WEIGHT = 2.0  # .. this many of them
DECAY = 0.9         # a step that gave a row drafts weighs its counts before by DECAY;
                    # a step that gave it none leaves them (RowAlpha.observe)


def default_budget(batch: int, gamma_max: int) -> int:
  """The verify budget N when none is given: every row's tail, plus twice
  as many drafts as rows (at least one whole draft, at most every row's)."""
  return batch + min(batch * gamma_max, max(gamma_max, 2 * batch))


@struct.dataclass
class RowAlpha:
  """Each row's acceptance so far (decayed counts, float32 [B]): accepted
  drafts and rejections (a step that stopped before the length it was given)."""
  n_accept: jax.Array
  n_reject: jax.Array

  @classmethod
  def start(cls, batch: int) -> "RowAlpha":
    return cls(n_accept=jnp.zeros((batch,), jnp.float32),
               n_reject=jnp.zeros((batch,), jnp.float32))

  def weight(self) -> jax.Array:
    """[B] the evidence behind alpha: decayed accepts and rejections."""
    return self.n_accept + self.n_reject

  def alpha(self) -> jax.Array:
    """[B] (accepted + prior) / (accepted + rejections + prior weight):
    autogamma.estimate_alpha per row."""
    return ((self.n_accept + PRIOR_ALPHA * PRIOR_WEIGHT)
            / (self.n_accept + self.n_reject + PRIOR_WEIGHT))

  def observe(self, n_acc, given, live) -> "RowAlpha":
    """After a step: row b (live) was given `given[b]` drafts and accepted
    n_acc[b]. A finished row's counts stay, and so do those of a row given
    nothing: a step that tested nothing says nothing of its acceptance
    (RowsJudged.observe passes a free test as a step given one draft). (When
    such steps decayed the counts, a row that had shown it accepts little
    drifted back to the prior in a few steps and budget=auto gave it a large
    block again: 0.86x against 0.90x at batch 8 on the mixed rows.)"""
    seen = live & (given > 0)
    acc = DECAY * self.n_accept + n_acc.astype(jnp.float32)
    rej = DECAY * self.n_reject + (n_acc < given).astype(jnp.float32)
    return RowAlpha(n_accept=jnp.where(seen, acc, self.n_accept),
                    n_reject=jnp.where(seen, rej, self.n_reject))


@struct.dataclass
class RowsDrafted(Drafted):
  """A chain's drafts with each row's length allotted (n_drafted)."""
  proposed: jax.Array = None  # [B] what the drafter proposed
  alpha: jax.Array = None     # [B] the running estimate the lengths came from ..
  weight: jax.Array = None    # [B] .. and its evidence (RowAlpha.weight)
  depth: jax.Array = None     # [] how deep it drafted (gamma_max, or the longest length)


@struct.dataclass
class RowsJudged(chain_step.Judged):
  """The chain's verdict, with each row's length given (its drafts verified)."""
  given: jax.Array = None     # [B]
  proposed: jax.Array = None  # [B]
  alpha: jax.Array = None     # [B]
  weight: jax.Array = None    # [B]
  free: jax.Array = None      # [B] int32 the free test of d_1: 1 hit, 0 miss, -1 none (free_test)

  def observe(self, rows: RowAlpha, live) -> RowAlpha:
    """A free test counts as a step given one draft (accepted if a hit)."""
    tested = self.free >= 0
    given = jnp.where(tested, 1, self.given)
    n_acc = jnp.where(tested, self.free.astype(self.n_acc.dtype), self.n_acc)
    return rows.observe(n_acc, given, live)

  def row_record(self, drafted) -> dict[str, jax.Array]:
    del drafted
    return {"proposed": self.proposed, "alpha": self.alpha, "weight": self.weight,
            "free": self.free}


def point_mass(sc) -> bool:
  """The drafts are a function of the context (an n-gram lookup, or any
  drafter at T = 0) and judged for real: accepting d_1 then happens with the
  probability that the target's own token is d_1 (free_test)."""
  return not sc.simulated and (sc.drafter.deterministic or sc.sp.greedy)


def free_test(drafted, emitted, given, sc):
  """[B] int32: for a row given no draft whose first draft was proposed (d_1
  is always drafted: a lookup's, or a network's root feed), 1 where the
  target's token is d_1 and 0 where not; -1 for every other row. For a
  point-mass proposal (point_mass) a hit has
  probability p(d_1), what accepting d_1 has (q(d_1) = 1): an unbiased test
  of the row's acceptance at no cost, so rows at the N = B step still learn."""
  tested = (given == 0) & (drafted.proposed > 0) & point_mass(sc)
  return jnp.where(tested, (emitted[:, 0] == drafted.tokens[:, 0]).astype(jnp.int32), -1)


def budget_of(sc, batch: int) -> int:
  """The step's verify budget N: sc.budget, or the default for the batch."""
  return sc.budget or default_budget(batch, sc.gamma)


def allotted_first(sc) -> bool:
  """The drafter proposes gamma_max for every row whatever it drafts, so the
  lengths can be allotted before it drafts, and it drafts only as deep as
  the longest (Drafter.drafts_to_depth; p_min would stop rows early)."""
  return sc.drafter.drafts_to_depth and sc.p_min == 0


def lengths(rows: RowAlpha, n_drafted, live, sc) -> jax.Array:
  """[B] each row's draft length this step (allocation.allocate from the rows'
  alpha, capped at what each row proposed; 0 for a finished row)."""
  limit = jnp.where(live, n_drafted, 0)
  return allocation.allocate(rows.alpha(), budget_of(sc, live.shape[0]), sc.gamma, limit=limit)


def verify_phase(tparams, tcache, tail, drafted: Drafted, sc):
  """The chain's verify_phase over a packed block of each row's 1 + l_b
  tokens (l_b: drafted.n_drafted, as allotted): p [B, gamma+1, V] (entries
  past a row's block are never read), the cache + 1 + l_b, features.

  A step that gives no row a draft runs the block too (each row's tail
  alone, the cache + 1), not a `lax.cond` to the decode program as chains
  do (chain_step.skipping_verify): around a conditional that writes the
  cache, XLA:CPU copies the whole cache three times a step (12 cache-sized
  copies in the tiny model's compiled verify), which made every step of a
  block with drafts cost 1.5x the tails' alone on SmolLM2 at batch 4. The
  tails-only step, a decode, is budget=auto's N = B candidate."""
  return packed_phase(tparams, tcache, tail, drafted, sc)


def packed_phase(tparams, tcache, tail, drafted: Drafted, sc):
  """verify_phase's packed block. The distributions are taken over the N
  tokens and then laid out per row: taken over the [B, gamma + 1, V] view,
  they cost B (gamma + 1) softmaxes or one-hots of the vocabulary whatever
  N is (at N = B, 5x the block's; 2 % of the loop step at batch 8)."""
  tokens = jnp.concatenate([tail[:, 1:], drafted.tokens], 1)  # [B, gamma+1]
  b, width = tokens.shape
  block = pk.pack(tokens, 1 + drafted.n_drafted, tcache.lengths, budget_of(sc, b))
  out = steps.packed_verify(tparams, block, tcache, sc.target,
                            return_hidden=sc.drafter.needs_features,
                            hidden_layers=sc.drafter.feature_layers)
  if sc.sp.greedy:  # one argmax a token; the one-hot of the view fuses into the judge's reads
    ids = block.to_rows(sampling.argmax(out[0]), tcache.lengths, width)
    p = jax.nn.one_hot(ids, out[0].shape[-1], dtype=jnp.float32)
  else:
    p = block.to_rows(sampling.probs(out[0], sc.sp), tcache.lengths, width)
  feats = block.to_rows(out[2], tcache.lengths, width) if sc.drafter.needs_features else None
  return p, out[1], feats


def fields_of(x) -> dict:
  """A struct's fields by name (to build its subclass from it)."""
  return {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}


class RowsStep(chain_step.ChainStep):
  """A chain step with per-row lengths in a packed verify (module docstring)."""

  @staticmethod
  def start_rows(batch: int) -> RowAlpha:
    return RowAlpha.start(batch)

  @classmethod
  def draft(cls, dparams, st, live, key, sc):
    """A drafter that always proposes gamma_max (allotted_first) drafts only
    as deep as the longest length: a step giving the rows few drafts (the
    tails alone: none) pays few draft forwards."""
    if not allotted_first(sc):
      return super().draft(dparams, st, live, key, sc)
    proposed = jnp.full(st.n.shape, sc.gamma, jnp.int32)
    depth = (0 if sc.tails_only(live.shape[0])  # known when traced: the root alone
             else jnp.max(lengths(st.rows, proposed, live, sc)))
    d, dcache, tcache = sc.drafter.propose(dparams, st.dcache, st.tcache, st.tail, st.n, live,
                                           key, sc, depth=depth)
    d = cls.allot(d.replace(n_drafted=proposed), st.rows, live, sc)  # the same lengths
    return d.replace(depth=jnp.asarray(depth, jnp.int32)), dcache, tcache

  @staticmethod
  def allot(drafted: Drafted, rows: RowAlpha, live, sc) -> RowsDrafted:
    return RowsDrafted(**fields_of(drafted), proposed=drafted.n_drafted, alpha=rows.alpha(),
                       weight=rows.weight(), depth=jnp.int32(sc.gamma)
                       ).replace(n_drafted=lengths(rows, drafted.n_drafted, live, sc))

  @staticmethod
  def verify(tparams, tcache, tail, drafted: Drafted, sc):
    return verify_phase(tparams, tcache, tail, drafted, sc)

  @staticmethod
  def judge(key, accept_probs, p, drafted, tail, n, live, sc) -> RowsJudged:
    j = chain_step.accept_phase(key, accept_probs, p, drafted, tail, n, live, sc)
    # a draft cache holds the root and the drafts fed: d_1 .. d_{depth-1}
    fed = n - 1 + jnp.maximum(drafted.depth, 1)
    return RowsJudged(**fields_of(j), given=drafted.n_drafted, proposed=drafted.proposed,
                      alpha=drafted.alpha, weight=drafted.weight,
                      free=free_test(drafted, j.emitted, drafted.n_drafted, sc)
                      ).replace(d_len=jnp.minimum(j.d_len, fed))


ROWS = RowsStep()
