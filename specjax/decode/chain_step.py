"""The chain's speculative step: gamma drafts, one verify over [last, d_1..
d_gamma], the accepted prefix and the target's token after it.

`ChainStep` and tree_step.TreeStep share one signature (propose -> verify
-> judge; the verdict commits itself), and SpecConfig.step picks one, so
no phase asks which shape it runs. The verdict `Judged` owns its commit:
the target cache rolled back by length (O(1), no copy), the drafter told
through a drafters.base.Committed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.decode import acceptance
from specjax.drafters.base import Committed, Drafted
from specjax.model import kv_cache as kvc
from specjax.model import llama as model
from specjax.model import sampling


@struct.dataclass
class Judged:
  """What the accept phase decided, and the bookkeeping it implies."""
  n_acc: jax.Array    # [B] drafts accepted
  emitted: jax.Array  # [B, gamma+1] d_1..d_k then the target's token (valid up to n_acc+1)
  tail: jax.Array     # [B, 2]
  n: jax.Array        # [B] sequence length after the step
  t_len: jax.Array    # [B] target cache length to roll back to
  d_len: jax.Array    # [B] a gamma-step draft cache's length to roll back to

  @property
  def leaf(self) -> jax.Array:
    """[B] the block index of the last accepted node (0: none): n_acc."""
    return self.n_acc

  def commit_target(self, tcache: kvc.KVCache, kept, dropped, live, features):
    """The target cache after the step (what the row kept, less what
    n_predict / EOS dropped) and the verify's features for the drafter."""
    del kept, live
    return kvc.rollback(tcache, self.t_len - dropped), features

  def committed(self, **kw) -> Committed:
    return Committed(n_acc=self.n_acc, emitted=self.emitted, d_len=self.d_len, **kw)

  def row_record(self, drafted) -> dict[str, jax.Array]:
    """The step's per-row lengths records (stats.ROW_FIELDS): what was proposed
    (all of it was verified), no alpha nor weight (0), no free test (-1)."""
    zero = jnp.zeros(drafted.n_drafted.shape, jnp.float32)
    return {"proposed": drafted.n_drafted.astype(jnp.int32), "alpha": zero, "weight": zero,
            "free": jnp.full(drafted.n_drafted.shape, -1, jnp.int32)}

  def observe(self, rows, live):
    """The loop's per-row state after the step (rows_step.RowAlpha; () unused)."""
    del live
    return rows


def verify_phase(tparams, tcache, tail, drafts, sc):
  """Target distributions p [B, gamma+1, V] at [last, d_1..d_gamma], tcache +
  gamma+1, and for a drafter that `needs_features` the target's final-normed
  hidden states there [B, gamma+1, E] (else None; the drafter's
  `feature_layers`: those layers' outputs [B, gamma+1, len * E])."""
  tokens = jnp.concatenate([tail[:, 1:], drafts], 1)  # [B, gamma+1]
  if sc.drafter.needs_features:
    logits, tcache, feats = model.forward(tparams, tokens, tcache, sc.target,
                                          return_hidden=True,
                                          hidden_layers=sc.drafter.feature_layers)
    return sampling.probs(logits, sc.sp), tcache, feats
  logits, tcache = model.forward(tparams, tokens, tcache, sc.target)
  return sampling.probs(logits, sc.sp), tcache, None


def anything_drafted(n_drafted) -> jax.Array:
  """Whether the step's verify is worth running: some row drafted a token."""
  return jnp.any(n_drafted > 0)


def padded(x, width: int):
  """x [B, T, ...] zero-padded to [B, width, ...] along axis 1 (None stays)."""
  if x is None:
    return None
  return jnp.pad(x, [(0, 0), (0, width - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def skipping_verify(full, n_drafted, tparams, tcache, tail, width: int, sc):
  """full(tcache) (a verify: p [B, width, V], the cache, features) when any
  row drafted, else the target's decode of the last token alone, padded to
  width: a step with nothing to verify costs one decode step, not a verify
  of width tokens (issue 40). The judge never reads past a row's drafts, and
  both roll the cache back to the same length, so the verdict is the same.
  One of the two runs (`either`). Only for drafters that can propose nothing
  (Drafter.may_draft_nothing): the decode branch is one more program."""
  def decode(cache):
    p, cache, feats = verify_phase(tparams, cache, tail, tail[:, :0], sc)
    return padded(p, width), cache, padded(feats, width)
  if not sc.drafter.may_draft_nothing or sc.simulated:
    return full(tcache)
  return either(ChainStep.worth_verifying(n_drafted), full, decode, tcache)


def either(pred, yes, no, cache):
  """yes(cache) if pred else no(cache), each -> (p, cache, extra): two
  while loops of zero or one trip, not a `lax.cond`. Both branches write
  the cache, and XLA:CPU copies a conditional's cache-sized operands three
  times (at 4 K and batch 1, 0.44 of a decode step's time); a while loop
  updates its carry in place. docs/long_context.md (n-gram without the
  cache copies)."""
  p, _, extra = jax.eval_shape(yes, cache)
  zero = lambda s: None if s is None else jnp.zeros(s.shape, s.dtype)
  def once(fn):
    def body(c):
      p, cache, extra = fn(c[2])
      return jnp.zeros((), bool), (p, extra), cache
    return body
  carry = (pred, (zero(p), zero(extra)), cache)
  carry = jax.lax.while_loop(lambda c: c[0], once(yes), carry)
  _, (p, extra), cache = jax.lax.while_loop(lambda c: c[0], once(no), (~pred,) + carry[1:])
  return p, cache, extra


def accept_phase(key, accept_probs, p, drafted: Drafted, tail, n, live, sc) -> Judged:
  """Judges the drafts and advances the sequence bookkeeping; rows that are
  not `live` (finished) keep their state."""
  gamma, drafts = sc.gamma, drafted.tokens
  n_acc, nxt = acceptance.judge(key, sc.simulated, accept_probs, sc.sp, drafts, drafted.q,
                                p, drafted.n_drafted, sc.drafter.deterministic)
  pos = jnp.arange(gamma + 1)[None, :]
  padded = jnp.concatenate([drafts, drafts[:, :1]], 1)
  emitted = jnp.where(pos == n_acc[:, None], nxt[:, None], padded)
  prev_last = jnp.take_along_axis(drafts, jnp.maximum(n_acc - 1, 0)[:, None], 1)[:, 0]
  prev = jnp.where(n_acc > 0, prev_last, tail[:, 1])
  keep = lambda new, old: jnp.where(live, new, old)
  new_n = n + n_acc + 1
  return Judged(
      n_acc=n_acc, emitted=emitted,
      tail=jnp.where(live[:, None], jnp.stack([prev, nxt], 1), tail),
      n=keep(new_n, n), t_len=keep(new_n - 1, n - 1),
      # The draft fed n-1+gamma entries (s_{n-1}, d_1..d_{gamma-1}); d_gamma
      # never entered it, so only a fully accepted step leaves it behind.
      d_len=keep(jnp.minimum(new_n - 1, n - 1 + gamma), n - 1))


class ChainStep:
  """A chain's phases (module docstring)."""

  @staticmethod
  def propose(dparams, dstate, tcache, tail, n, live, key, sc):
    return sc.drafter.propose(dparams, dstate, tcache, tail, n, live, key, sc)

  @classmethod
  def draft(cls, dparams, st, live, key, sc):
    """The step's drafts as verified: propose, then allot. Returns
    (Drafted, dstate, tcache); st: the loop's SpecState."""
    d, dcache, tcache = cls.propose(dparams, st.dcache, st.tcache, st.tail, st.n, live, key, sc)
    return cls.allot(d, st.rows, live, sc), dcache, tcache

  @staticmethod
  def start_rows(batch: int):
    """The loop's per-row state before step 0: none (rows_step.RowsStep's: alpha)."""
    del batch
    return ()

  @staticmethod
  def allot(drafted, rows, live, sc):
    """The drafts each row verifies: all it proposed (rows_step.RowsStep: its length)."""
    del rows, live, sc
    return drafted

  @staticmethod
  def worth_verifying(n_drafted) -> jax.Array:
    """The verify's predicate (anything_drafted; a method so a test can break it)."""
    return anything_drafted(n_drafted)

  @staticmethod
  def verify(tparams, tcache, tail, drafted: Drafted, sc):
    """The verify of [last, drafts], or a decode step when no row drafted."""
    return skipping_verify(lambda cache: verify_phase(tparams, cache, tail, drafted.tokens, sc),
                           drafted.n_drafted, tparams, tcache, tail, sc.gamma + 1, sc)

  @staticmethod
  def judge(key, accept_probs, p, drafted, tail, n, live, sc) -> Judged:
    return accept_phase(key, accept_probs, p, drafted, tail, n, live, sc)

  @staticmethod
  def accept_table(rule: acceptance.AcceptRule, sc) -> np.ndarray:
    """The traced per-position probabilities of a simulated rule [gamma]."""
    return acceptance.position_probs(rule, sc.gamma)


CHAIN = ChainStep()
