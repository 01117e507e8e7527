"""Speculative decoding as fixed-shape XLA programs.

One step, for every row b of the batch (n = tokens so far, `last` = the last
emitted token, not yet seen by the target):
  draft:   the drafter (specjax.drafters.base: the draft model, n-gram lookup, the
           target's own first layers...) proposes drafts [B, gamma], their
           q [B, gamma, V] (none for a deterministic drafter) and n_drafted;
           the draft model runs gamma T=1 steps in one lax.scan
  verify:  one target forward over [last, d_1..d_gamma] (T = gamma+1)
           -> p [B, gamma+1, V]
  accept:  k accepted drafts and one target token (acceptance.judge)
  commit:  keep d_1..d_k and that token (fewer when n_predict or EOS cuts the
           step short); set the target cache's length (rollback by length,
           no copy); the drafter commits its own state.
Invariant between steps: the target cache holds the kept sequence minus
`last` (length n-1). The draft model's cache holds the same, except after a
step that accepted all gamma drafts: then it lacks d_gamma too (length n-2),
and the next draft phase first feeds it (the catch-up, a lax.cond), so no
token is dropped or duplicated.

A row that has finished (n_predict tokens, or EOS) still rides along in the
fixed-shape steps of the rows that have not. Its lengths are cut back to the
tokens it kept, so its later writes land past its kept sequence and inside
the cache (capacity = prompt + n_predict + gamma covers them): nothing it
kept is overwritten and nothing is written out of range, where XLA would clamp
the write silently. Only live rows count in the capacity checks and the
statistics.

Two loops run the same phase functions with the same keys and emit identical
tokens: `device` (one lax.while_loop, one host transfer at the end) and `host`
(a Python loop that times draft, verify and accept separately).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.decode import acceptance
from specjax.decode import tree_step
from specjax.drafters import registry
from specjax.drafters.draft_model import MODEL
from specjax.decode import generation
from specjax.model import llama as model
from specjax.model import sampling
from specjax.model import sharding
from specjax.model import steps
from specjax.model import kv_cache as kvc
from specjax.decode.acceptance import AcceptRule
from specjax.model.config import ModelConfig
from specjax.model.tree import Tree
from specjax.drafters.base import Committed, Drafted, Drafter
from specjax.errors import ConfigError
from specjax.model.sampling import SamplingParams
from specjax.metrics.stats import Records, SpecStats
from specjax.metrics.timing import CompileWatch, block


@dataclasses.dataclass(frozen=True)
class SpecConfig:
  """Static settings of a speculative run (a jit static argument).

  `draft` is the config of the model the drafter runs: the draft model's for
  `model`, the target's subset for `layerskip` (set here from the target),
  None for `ngram`."""
  target: ModelConfig
  draft: ModelConfig | None
  gamma: int
  sp: SamplingParams = SamplingParams()
  simulated: bool = False  # a simulated rule; its per-position probabilities are traced
  p_min: float = 0.0    # draft early stop: stop when the draft's top prob < p_min
  drafter: Drafter = MODEL
  tree: Tree | None = None  # a static token tree (gamma = its depth); None: the chain
  siblings: str = "topk"    # a tree's siblings: the draft's top-k, or i.i.d. draws from q

  def __post_init__(self):
    if self.gamma < 1:
      raise ConfigError(f"gamma (draft length) must be >= 1, got {self.gamma}")
    if not 0.0 <= self.p_min <= 1.0:
      raise ConfigError(f"p_min must lie in [0, 1], got {self.p_min}")
    if self.siblings not in ("topk", "stochastic"):
      raise ConfigError(f"siblings must be 'topk' or 'stochastic', got {self.siblings!r}")
    if self.tree is not None and self.gamma != self.tree.max_depth:
      raise ConfigError(f"a tree of depth {self.tree.max_depth} runs at gamma = its depth, "
                        f"got gamma {self.gamma}")
    if self.tree is not None and self.p_min > 0:
      raise ConfigError("p_min (draft early stop) is for chains; a tree drafts every node")
    object.__setattr__(self, "drafter", registry.parse(self.drafter))
    if self.tree is not None:
      self.drafter.check_tree(self.tree)
    if getattr(self.tree, "ngram", 0) and self.drafter.kind != "eagle":
      raise ConfigError(f"--tree={self.tree.spec} grafts a prompt-lookup chain onto an EAGLE "
                        f"head's tree; drafter {self.drafter.spec} cannot (use --drafter=eagle"
                        "[:PATH])")
    object.__setattr__(self, "draft", self.drafter.draft_config(self.target, self.draft))
    if self.draft is not None:
      check_vocabularies(self.target, self.draft)

  @property
  def needs_q(self) -> bool:
    """Only exact sampling reads the draft distributions q (a deterministic
    drafter's q is onehot(x), never materialised)."""
    return (not self.simulated and not self.sp.greedy and not self.drafter.deterministic
            and (self.tree is None or self.siblings == "stochastic"))

  @property
  def block(self) -> int:
    """Slots one step writes past the cache's length: gamma + 1, a tree's
    1 + N, or a dynamic tree's larger of that and what its draft feeds."""
    if self.tree is None:
      return self.gamma + 1
    return max(self.tree.block_size, getattr(self.tree, "n_fed", 0))


def check_vocabularies(target: ModelConfig, draft: ModelConfig) -> None:
  """Speculative decoding compares token ids: the two vocabularies must match."""
  if target.vocab_size != draft.vocab_size:
    raise ConfigError(
        f"draft and target vocabularies differ: target {target.name} has "
        f"{target.vocab_size} tokens, draft {draft.name} has {draft.vocab_size}")


@struct.dataclass
class SpecState:
  tcache: kvc.KVCache
  dcache: Any      # the drafter's state (any pytree): the draft model's KVCache,
                   # the n-gram history [B, S], () for layerskip:N ...
  tail: jax.Array  # [B, 2] the last two kept tokens (prev, last)
  n: jax.Array     # [B] sequence length so far (prompt + kept tokens)


@struct.dataclass
class Judged:
  """What the accept phase decided, and the bookkeeping it implies."""
  n_acc: jax.Array    # [B] drafts accepted
  emitted: jax.Array  # [B, gamma+1] d_1..d_k then the target's token (valid up to n_acc+1)
  tail: jax.Array     # [B, 2]
  n: jax.Array        # [B] sequence length after the step
  t_len: jax.Array    # [B] target cache length to roll back to
  d_len: jax.Array    # [B] a gamma-step draft cache's length to roll back to
  path: Any = None    # a tree's step: [B, D] the accepted nodes' block indices
  draft_path: Any = None  # ... and their slots in the draft's scratch layout


def verify_phase(tparams, tcache, tail, drafts, sc: SpecConfig):
  """Target distributions p [B, gamma+1, V] at [last, d_1..d_gamma]; tcache + gamma+1.

  For a drafter that `needs_features`, also the target's final-normed hidden
  states there, [B, gamma+1, E] (a third result)."""
  tokens = jnp.concatenate([tail[:, 1:], drafts], 1)  # [B, gamma+1]
  if sc.drafter.needs_features:
    logits, tcache, feats = model.forward(tparams, tokens, tcache, sc.target,
                                          return_hidden=True)
    return sampling.probs(logits, sc.sp), tcache, feats
  logits, tcache = model.forward(tparams, tokens, tcache, sc.target)
  return sampling.probs(logits, sc.sp), tcache


def _verify(tparams, tcache, tail, drafts, sc: SpecConfig):
  """verify_phase (a tree's, with sc.tree) as (p, tcache, features or None)."""
  if sc.tree is not None:
    return tree_step.verify_phase(tparams, tcache, tail, drafts, sc)
  out = verify_phase(tparams, tcache, tail, drafts, sc)
  return out if len(out) == 3 else (*out, None)


def accept_phase(key, accept_probs, p, drafted: Drafted, tail, n, live,
                 sc: SpecConfig) -> Judged:
  """Judges the drafts and advances the sequence bookkeeping.

  Rows that are not `live` (finished) keep their state.
  """
  if sc.tree is not None:
    return _accept_tree(key, accept_probs, p, drafted, tail, n, live, sc)
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
      # After the scan the draft cache holds n-1+gamma entries (s_{n-1},
      # d_1..d_{gamma-1}); d_gamma never entered it, so only a fully accepted
      # step leaves it behind.
      d_len=keep(jnp.minimum(new_n - 1, n - 1 + gamma), n - 1))


def _accept_tree(key, accept_probs, p, drafted, tail, n, live, sc: SpecConfig) -> Judged:
  """accept_phase for a token tree: the accepted path's tokens then the
  target's token, as a chain of that length would emit them."""
  v = tree_step.judge(key, accept_probs, p, drafted, sc)
  block = jnp.concatenate([tail[:, 1:], drafted.tokens], 1)  # [B, 1+N]
  emitted = tree_step.emitted(block, v)  # [B, D+1]
  last = jnp.take_along_axis(emitted, v.n_accepted[:, None], 1)[:, 0]
  prev = jnp.take_along_axis(jnp.concatenate([tail[:, 1:], emitted], 1),
                             v.n_accepted[:, None], 1)[:, 0]
  keep = lambda new, old: jnp.where(live, new, old)
  new_n = n + v.n_accepted + 1
  # The draft fed the root and every accepted node but perhaps the last (a
  # static tree's deepest level, a dynamic tree's node outside its frontier).
  dpath = tree_step.draft_path(drafted, v.path, sc)
  n_fed = jnp.sum(dpath >= 0, -1)
  return Judged(n_acc=v.n_accepted, emitted=emitted,
                tail=jnp.where(live[:, None], jnp.stack([prev, last], 1), tail),
                n=keep(new_n, n), t_len=keep(new_n - 1, n - 1),
                d_len=keep(n + n_fed, n - 1), path=v.path, draft_path=dpath)


def keep_tokens(out, count, done, j: Judged, eos_id: int, n_predict: int):
  """Writes the step's tokens at each row's count, at most up to n_predict
  and the first EOS. Returns (out, count, done, kept [B] tokens kept)."""
  g1 = j.emitted.shape[1]
  pos = jnp.arange(g1)[None, :]
  valid = pos < (j.n_acc + 1)[:, None]
  is_eos = valid & (j.emitted == eos_id)
  first_eos = jnp.where(jnp.any(is_eos, 1), jnp.argmax(is_eos, 1) + 1, g1 + 1)
  kept = jnp.minimum(j.n_acc + 1, first_eos)
  kept = jnp.where(done, 0, jnp.minimum(kept, n_predict - count))
  write = jax.vmap(lambda o, e, c: jax.lax.dynamic_update_slice(o, e, (c,)))
  out = jnp.where(done[:, None], out, write(out, j.emitted, count))
  count = count + kept
  done = done | (count >= n_predict) | (kept >= first_eos)
  return out, count, done, kept


def commit(tcache, dcache, tail, j: Judged, kept, live, drafter: Drafter = MODEL,
           features=None) -> SpecState:
  """The state after a step: the target cache rolled back to what the row
  kept, the drafter's state committed (the draft model's cache likewise).

  A step emits n_acc + 1 tokens; when n_predict or EOS cuts it short, the
  tokens past `kept` are dropped from the sequence, from both caches and from
  the tail, so a finished row's state is exactly its output, and its later
  (ignored) writes land past it and inside the capacity.
  """
  dropped = jnp.where(live, j.n_acc + 1 - kept, 0)
  n = j.n - dropped
  n_prev = jnp.where(live, j.n - j.n_acc - 1, j.n)
  if j.path is None:
    tcache = kvc.rollback(tcache, j.t_len - dropped)
  else:  # the kept path's K/V into place (root + kept - 1 nodes), its features in order
    tcache = kvc.commit_path(tcache, j.path, jnp.where(live, kept - 1, -1))
    features = None if features is None else tree_step.path_features(features, j.path)
  c = Committed(n_prev=n_prev, n=n, n_acc=j.n_acc, emitted=j.emitted,
                kept=jnp.where(live, kept, 0), live=live, d_len=j.d_len, features=features,
                path=j.path, draft_path=j.draft_path)
  # [last, e_1 .. e_{gamma+1}]: the kept tail is (ext[kept - 1], ext[kept])
  ext = jnp.concatenate([tail[:, 1:], j.emitted], 1)
  at = lambda i: jnp.take_along_axis(ext, jnp.maximum(i, 0)[:, None], 1)[:, 0]
  cut_tail = jnp.stack([at(kept - 1), at(kept)], 1)
  return SpecState(tcache=tcache,
                   dcache=drafter.commit(dcache, c),
                   tail=jnp.where((dropped > 0)[:, None], cut_tail, j.tail), n=n)


# stats.Records + live + leaf (the block index of the last accepted node, 0: none; a
# chain's n_acc): a static tree's accepted path, hence its per-rank tries and
# accepts (tree_theory.rank_counts), for --tree=auto's estimate of p
REC_FIELDS = ("n_acc", "n_drafted", "kept", "caught_up", "live", "leaf")


def _record_row(j: Judged, d: Drafted, kept, live) -> dict[str, jax.Array]:
  """One step's per-row record (see stats.Records)."""
  leaf = j.n_acc if j.path is None else jnp.take_along_axis(
      jnp.concatenate([jnp.zeros_like(j.path[:, :1]), j.path], 1), j.n_acc[:, None], 1)[:, 0]
  return {"n_acc": j.n_acc, "n_drafted": d.n_drafted, "kept": kept,
          "caught_up": d.caught_up.astype(jnp.int32), "live": live.astype(jnp.int32),
          "leaf": leaf.astype(jnp.int32)}


@dataclasses.dataclass
class SpecResult:
  tokens: list[list[int]]   # generated ids per row (prompt excluded)
  stats: SpecStats
  prompt_s: float           # prefill of both models
  eval_s: float             # speculative loop
  compile_s: float = 0.0
  records: Records | None = None  # per-step records behind `stats`
  state: SpecState | None = None  # final state (caches), when asked for


def _steps(key, i, tparams, dparams, st: SpecState, done, accept_probs, sc):
  """The phases of step i, in order (shared by both loops through jit)."""
  kd, ka = jax.random.split(jax.random.fold_in(key, i))
  d, dcache, tcache = _propose(dparams, st.dcache, st.tcache, st.tail, st.n, ~done, kd, sc)
  p, tcache, feats = _verify(tparams, tcache, st.tail, d.tokens if sc.tree is None else d, sc)
  j = accept_phase(ka, accept_probs, p, d, st.tail, st.n, ~done, sc)
  return d, dcache, tcache, j, feats


def _run_steps(tparams, dparams, st: SpecState, out, count, done, i, rec, key, accept_probs,
               stop, sc: SpecConfig, n_predict: int, eos_id: int):
  """Steps i, i+1, .. of the loop until step `stop` or every row is done."""

  def cond(c):
    i, _, _, _, done, _ = c
    return (i < stop) & ~jnp.all(done)

  def body(c):
    i, st, out, count, done, rec = c
    d, dcache, tcache, j, feats = _steps(key, i, tparams, dparams, st, done, accept_probs, sc)
    out, count, new_done, kept = keep_tokens(out, count, done, j, eos_id, n_predict)
    row = _record_row(j, d, kept, ~done)
    rec = {k: rec[k].at[i].set(row[k]) for k in REC_FIELDS}
    st = commit(tcache, dcache, st.tail, j, kept, ~done, sc.drafter, feats)
    return i + 1, st, out, count, new_done, rec

  return jax.lax.while_loop(cond, body, (jnp.asarray(i, jnp.int32), st, out, count, done, rec))


def loop_start(out, eos_id: int, n_predict: int):
  """(count, done, records) before step 0; out [B, W] holds the first tokens."""
  b = out.shape[0]
  count = jnp.ones((b,), jnp.int32)
  done = (out[:, 0] == eos_id) | (n_predict <= 1)
  return count, done, {k: jnp.zeros((n_predict, b), jnp.int32) for k in REC_FIELDS}


@functools.partial(jax.jit, static_argnames=("sc", "n_predict", "eos_id"),
                   donate_argnames=("state",))
def spec_loop(tparams, dparams, state: SpecState, out, key, accept_probs, *, sc: SpecConfig,
              n_predict: int, eos_id: int):
  """The whole speculative generation on device (one lax.while_loop).

  Returns (out [B, n_predict + gamma + 1], count [B], records, final state).
  """
  count, done, rec = loop_start(out, eos_id, n_predict)
  _, st, out, count, _, rec = _run_steps(tparams, dparams, state, out, count, done, 0, rec, key,
                                         accept_probs, n_predict, sc, n_predict, eos_id)
  return out, count, rec, st


@functools.partial(jax.jit, static_argnames=("sc", "n_predict", "eos_id"),
                   donate_argnames=("state", "rec"))
def spec_chunk(tparams, dparams, state: SpecState, out, count, done, i, rec, key, accept_probs,
               n_steps, *, sc: SpecConfig, n_predict: int, eos_id: int):
  """At most n_steps steps of spec_loop from step i (both traced: chunks of
  any length share one program) and a given (state, out, count, done,
  records): a host loop may switch gamma between chunks (SpecState does not
  depend on gamma; `out` must be at least n_predict + max gamma wide).
  Returns (i, state, out, count, done, rec)."""
  stop = jnp.minimum(i + n_steps, n_predict)
  return _run_steps(tparams, dparams, state, out, count, done, i, rec, key, accept_probs, stop,
                    sc, n_predict, eos_id)


def _propose(dparams, dcache, tcache, tail, n, live, key, sc: SpecConfig):
  if sc.tree is not None:
    return sc.drafter.propose_tree(dparams, dcache, tcache, tail, n, live, key, sc)
  return sc.drafter.propose(dparams, dcache, tcache, tail, n, live, key, sc)


draft_jit = jax.jit(_propose, static_argnames=("sc",), donate_argnames=("dcache", "tcache"))
verify_jit = jax.jit(_verify, static_argnames=("sc",), donate_argnames=("tcache",))
accept_jit = jax.jit(accept_phase, static_argnames=("sc",))


@functools.partial(jax.jit, static_argnames=("eos_id", "n_predict", "drafter"),
                   donate_argnames=("tcache", "dcache"))
def _keep_and_commit(out, count, done, j, d, tcache, dcache, tail, feats, *, eos_id, n_predict,
                     drafter):
  """The host loop's bookkeeping: keep_tokens, commit and the step's record."""
  out, count, new_done, kept = keep_tokens(out, count, done, j, eos_id, n_predict)
  st = commit(tcache, dcache, tail, j, kept, ~done, drafter, feats)
  return out, count, new_done, st, _record_row(j, d, kept, ~done)


_split_jit = jax.jit(lambda key, i: jax.random.split(jax.random.fold_in(key, i)))


def _host_loop(tparams, dparams, st: SpecState, out, key, accept_probs, sc, n_predict, eos_id):
  """The host-driven twin of spec_loop; returns the same plus phase times."""
  b = out.shape[0]
  count = jnp.ones((b,), jnp.int32)
  done = np.asarray((out[:, 0] == eos_id) | (n_predict <= 1))
  recs = {k: [] for k in REC_FIELDS}
  phase = {"draft_s": 0.0, "verify_s": 0.0, "accept_s": 0.0}
  for i in range(n_predict):
    if done.all():
      break
    kd, ka = _split_jit(key, i)
    # live rows only: a finished row writes past its kept tokens, in range
    kvc.check_capacity(np.asarray(st.n)[~done] - 1, sc.block, st.tcache.capacity)
    live = jnp.asarray(~done)
    t0 = time.perf_counter()
    d, dcache, tcache = block(draft_jit(dparams, st.dcache, st.tcache, st.tail, st.n, live, kd,
                                        sc=sc))
    t1 = time.perf_counter()
    p, tcache, feats = block(verify_jit(tparams, tcache, st.tail,
                                        d.tokens if sc.tree is None else d, sc=sc))
    t2 = time.perf_counter()
    j = block(accept_jit(ka, accept_probs, p, d, st.tail, st.n, live, sc=sc))
    phase["draft_s"] += t1 - t0
    phase["verify_s"] += t2 - t1
    phase["accept_s"] += time.perf_counter() - t2
    out, count, done, st, row = _keep_and_commit(out, count, ~live, j, d, tcache, dcache,
                                                 st.tail, feats, eos_id=eos_id,
                                                 n_predict=n_predict, drafter=sc.drafter)
    for k in REC_FIELDS:
      recs[k].append(np.asarray(row[k], np.int32))
    done = np.asarray(done)
  rec = {k: np.stack(v) if v else np.zeros((0, b), np.int32) for k, v in recs.items()}
  return out, count, rec, st, phase


def prefill(target: steps.Runner, dparams, prompts, capacity: int, key,
            sc: SpecConfig) -> tuple[SpecState, jax.Array]:
  """The target's cache filled with the prompts, the first token sampled from
  the target (fold_in(key, 0), as target-only generation draws it), and the
  drafter's initial state (the draft model's prefilled cache, ...).
  Returns (state, first tokens [B])."""
  logits, tcache = target.prefill(prompts, target.new_cache(len(prompts), capacity))
  first = generation.sample_jit(jax.random.fold_in(key, 0), logits, sp=sc.sp)
  dstate = sc.drafter.init(sc, target, dparams, prompts, capacity, first)
  prev = jnp.asarray([p[-1] for p in prompts], jnp.int32)
  st = SpecState(tcache=tcache, dcache=dstate, tail=jnp.stack([prev, first], 1),
                 n=tcache.lengths + 1)
  return block(st), first


def generate(target: steps.Runner, draft: steps.Runner | None, prompts, n_predict: int,
             gamma: int, sp: SamplingParams = SamplingParams(),
             rule: AcceptRule | str = "real", seed: int = 0,
             eos_id: int | None = None, loop: str = "device", p_min: float = 0.0,
             ctx_size: int | None = None, capacity: int | None = None,
             keep_state: bool = False, drafter: Drafter | str = "model",
             tree: Tree | None = None, siblings: str = "topk") -> SpecResult:
  """Speculative generation of n_predict tokens after each prompt.

  `drafter` (a spec, see specjax.drafters.base.parse, or a Drafter) proposes the
  drafts; `draft` is the draft model of the `model` drafter (None for the
  others). `tree` (specjax.model.tree) drafts and verifies a static token
  tree instead of a chain (gamma is then its depth; `siblings`: the draft's
  top-k or i.i.d. draws from q). `keep_state` returns the final caches in
  `SpecResult.state` (tests read them); otherwise they are freed.
  """
  if loop not in ("device", "host"):
    raise ConfigError(f"loop must be 'device' or 'host', got {loop!r}")
  drafter = registry.parse(drafter)
  gamma = gamma if tree is None else tree.max_depth
  rule = acceptance.parse_rule(rule) if isinstance(rule, str) else rule
  rule = rule.resolve(gamma)
  sc = SpecConfig(target.cfg, draft.cfg if draft is not None else None, gamma, sp,
                  rule.simulated, p_min, drafter, tree, siblings)
  dparams = drafter.draft_params(target.params, draft)
  accept_probs = jnp.asarray(acceptance.position_probs(rule, gamma) if tree is None
                             else tree_step.accept_probs(rule, tree))
  eos = generation.NO_EOS if eos_id is None else int(eos_id)
  p_len = max(len(p) for p in prompts)
  cap = generation.plan_capacity(target.cfg, p_len, n_predict, extra=sc.block - 1,
                                 ctx_size=ctx_size, capacity=capacity)
  key = jax.random.PRNGKey(seed)
  with CompileWatch() as cw:
    t0 = time.perf_counter()
    st, first = prefill(target, dparams, prompts, cap, key, sc)
    prompt_s = time.perf_counter() - t0
    out = jnp.full((len(prompts), n_predict + gamma + 1), eos, jnp.int32)
    out = out.at[:, 0].set(first)
    step_key = jax.random.fold_in(key, 1)
    t0 = time.perf_counter()
    if loop == "device":
      out, count, rec, st = block(spec_loop(target.params, dparams, st, out, step_key,
                                            accept_probs, sc=sc, n_predict=n_predict,
                                            eos_id=eos))
      phase = {}
    else:
      out, count, rec, st, phase = _host_loop(target.params, dparams, st, out,
                                              step_key, accept_probs, sc, n_predict, eos)
    eval_s = time.perf_counter() - t0
  out, count = sharding.to_host(out), sharding.to_host(count)
  rec = {k: sharding.to_host(v) for k, v in rec.items()}
  rows = [out[b, :count[b]].tolist() for b in range(len(prompts))]
  records = Records.from_arrays(rec)
  stats = SpecStats.compute(records, gamma=gamma, n_predict=int(count.sum()),
                            eval_s=eval_s, phase_s=phase)
  return SpecResult(tokens=rows, stats=stats, prompt_s=prompt_s, eval_s=eval_s,
                    compile_s=cw.seconds, records=records,
                    state=st if keep_state else None)
