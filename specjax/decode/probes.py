"""Timed probes of the speculative loop's phases, measured the way the
device loop pays them (no host dispatch): k repetitions inside one jitted
loop, time per repetition.
  CostProbe       T(n): one model forward over n new tokens (any batch)
                  against a cache of the run's capacity holding `depth`
                  tokens, its logits consumed as the run consumes them
                  (argmax when greedy; the sampling distribution and a draw
                  otherwise). n = 1 is a decode step; n = gamma + 1 a verify.
  ProposeProbe    a model-free drafter's proposal (n-gram lookup), per token.
  PackedProbe     T_packed(B, N): the packed verify of N tokens (model/packed.py).
  accept_cost     one accept phase plus the step's bookkeeping (keep_tokens,
                  commit) for a rule kind, gamma and sampling settings;
                  tree_accept_cost the same for a token tree (its judge).
Auto gamma measures its costs with these at start; the sweep's cost model
(specjax/bench/sweep/costs.py) predicts speedups from them."""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence
import jax
import jax.numpy as jnp
import numpy as np
from specjax.model import kv_cache as kvc
from specjax.model import llama as model_lib
from specjax.model import packed as pk
from specjax.model import sampling
from specjax.decode import plan
from specjax.decode import speculative
from specjax.model import steps
from specjax.metrics import timing
from specjax.model.sampling import SamplingParams
from specjax.drafters import draft_model
from specjax.drafters import vocab
from specjax.drafters.base import Drafted, DraftedTree


REPEATS = 8  # forwards (or accept phases) per timed repetition
PROBE_REPEATS = 4  # ... in the sweep's probes, which it repeats (sweep.PROBE_REPS)


@functools.partial(jax.jit, static_argnames=("cfg", "k", "sp"), donate_argnames=("cache",))
def repeat_forward(params, tokens, cache: kvc.KVCache, key, cfg, k: int, sp: SamplingParams):
  """k forwards of tokens from the same cache state, on device (no dispatch),
  each followed by what a run does with the logits (a draft's params with a
  reduced vocabulary: its head over the set, as the drafter runs it)."""
  depth = cache.lengths

  def body(i, carry):
    c, acc = carry
    if vocab.PARAMS_KEY in params:  # a draft over a reduced set: its own head's product
      _, c, hidden = model_lib.forward(params, tokens, c, cfg, head=False)
      logits = vocab.draft_logits(params, hidden, cfg.padded_vocab)
    else:
      logits, c = model_lib.forward(params, tokens, c, cfg)
    # Consume every logit, as decoding does: keeping only a slice would let
    # XLA shrink the lm_head matmul to that slice.
    tok = sampling.sample_logits(jax.random.fold_in(key, i), logits, sp)
    return kvc.rollback(c, depth), acc + jnp.sum(tok, -1)

  cache, acc = jax.lax.fori_loop(0, k, body,
                                 (cache, jnp.zeros(tokens.shape[:1], jnp.int32)))
  return acc, cache


def random_tokens(rng: np.random.RandomState, vocab: int, b: int, t: int) -> jax.Array:
  return jnp.asarray(rng.randint(0, vocab, (b, t)), jnp.int32)


TILE = 64  # random_slots: distinct K/V slots, repeated along the depth


@functools.partial(jax.jit, static_argnames=("depth",), donate_argnames=("cache",))
def random_slots(cache: kvc.KVCache, key, depth: int) -> kvc.KVCache:
  """`cache` with each row's first `depth` slots holding random K/V (a
  normal tile of TILE slots, repeated) and its lengths at `depth`."""
  keys = jax.random.split(key, 2 * len(cache.k))

  def fill(arr, k):
    b, h, _, d = arr.shape
    tile = jax.random.normal(k, (1, h, min(depth, TILE), d), jnp.float32).astype(arr.dtype)
    block = jnp.tile(tile, (b, 1, -(-depth // tile.shape[2]), 1))[:, :, :depth]
    return jax.lax.dynamic_update_slice(arr, block, (0, 0, 0, 0))

  n = len(cache.k)
  return kvc.KVCache(k=tuple(fill(a, keys[i]) for i, a in enumerate(cache.k)),
                     v=tuple(fill(a, keys[n + i]) for i, a in enumerate(cache.v)),
                     lengths=jnp.full_like(cache.lengths, depth))


def filled_cache(m: steps.Runner, batch: int, capacity: int, depth: int,
                 rng: np.random.RandomState) -> kvc.KVCache:
  """A new cache holding `depth` slots of random K/V per row (untimed setup).
  A probe times what a step computes, and attention's cost does not depend
  on the values it reads; prefilling random tokens instead cost a prefill of
  batch x depth tokens (at 4 K and batch 8 on 2 CPU cores, about 20 minutes)."""
  cache = m.new_cache(batch, capacity)
  if depth:
    cache = timing.block(random_slots(cache, jax.random.PRNGKey(rng.randint(1 << 31)), depth))
  return committed(cache, m.params)


def committed(cache: kvc.KVCache, params) -> kvc.KVCache:
  """A cache placed on the params' device, as a step's output is: an
  uncommitted cache beside committed params would compile a probe's step
  twice (its first output is committed), the second time inside the timed
  repetitions. A cache on a mesh is already placed (Runner.new_cache)."""
  leaf = jax.tree.leaves(params)[0]
  if (not isinstance(cache.k[0].sharding, jax.sharding.SingleDeviceSharding)
      or not getattr(leaf, "committed", True)):
    return cache  # placed already, or params as uncommitted as the cache
  return jax.device_put(cache, next(iter(leaf.devices())))


class CostProbe:
  """Measures T(n) of one model: a forward over n new tokens per row (batch
  `batch`, 1 by default) against a cache of `capacity` slots already holding
  `depth` tokens per row.

  Each repetition runs k forwards inside one jitted loop and reports the time
  per forward, so host dispatch (which the on-device loop never pays) stays
  out. The probe keeps its cache, so it can be called again and again between
  other measurements (the sweep interleaves it with the runs it predicts).
  """

  def __init__(self, m: steps.Runner, capacity: int, depth: int, seed: int = 0,
               k: int = REPEATS, batch: int = 1):
    self.m, self.k, self.capacity, self.depth, self.batch = m, k, capacity, depth, batch
    self.rng = np.random.RandomState(seed)
    self.holder = [filled_cache(m, batch, capacity, depth, self.rng)]
    self.tokens: dict[int, jax.Array] = {}
    self.warm: set[tuple[int, SamplingParams]] = set()

  def times(self, ns: Sequence[int], reps: int = 1,
            sp: SamplingParams = SamplingParams()) -> dict[int, timing.Timing]:
    """Per-forward timings for each n (a new (n, sp) compiles on first use)."""
    kvc.check_capacity([self.depth], max(ns), self.capacity)
    out = {}
    for n in sorted(set(ns)):
      if n not in self.tokens:
        self.tokens[n] = random_tokens(self.rng, self.m.cfg.vocab_size, self.batch, n)
      key = jax.random.PRNGKey(n)

      def run(tokens=self.tokens[n], key=key):
        acc, self.holder[0] = repeat_forward(self.m.params, tokens, self.holder[0], key,
                                              cfg=self.m.cfg, k=self.k, sp=sp)
        return acc

      first = (n, sp) not in self.warm
      self.warm.add((n, sp))
      t = timing.measure(run, reps=reps, warmup=1 if first else 0)
      out[n] = dataclasses.replace(t, times=[x / self.k for x in t.times])
    return out


@functools.partial(jax.jit, static_argnames=("cfg", "k"), donate_argnames=("cache",))
def repeat_packed(params, packed: pk.Packed, cache: kvc.KVCache, cfg, k: int):
  """k packed verifies of one block from the same cache state, on device."""
  depth = cache.lengths

  def body(i, carry):
    c, acc = carry
    logits, c = steps.packed_verify(params, packed.replace(tokens=packed.tokens + i % 2), c, cfg)
    return kvc.rollback(c, depth), acc + jnp.sum(jnp.argmax(logits, -1))

  cache, acc = jax.lax.fori_loop(0, k, body, (cache, jnp.int32(0)))
  return acc, cache


def ragged_counts(batch: int, size: int, gamma: int) -> np.ndarray:
  """[B] tokens per row for a block of `size`: every row its tail, the rest
  given row by row up to gamma drafts each (the widest rows a budget allows)."""
  extra = np.zeros(batch, np.int64)
  left = size - batch
  for b in range(batch):
    extra[b] = min(gamma, left)
    left -= extra[b]
  return 1 + extra


class PackedProbe:
  """T_packed(B, N): the target's packed verify of a block of N tokens (B
  rows of gamma_max + 1 at most, laid out by ragged_counts: the cost follows
  N, not the layout) against a cache of `capacity` slots holding `depth`
  tokens per row; k verifies per timed repetition in one jitted loop, the
  logits consumed by an argmax. The same `times` interface as CostProbe."""

  def __init__(self, m: steps.Runner, capacity: int, depth: int, batch: int, gamma_max: int,
               seed: int = 0, k: int = REPEATS):
    self.m, self.k, self.batch, self.gamma_max = m, k, batch, gamma_max
    self.capacity, self.depth = capacity, depth
    self.rng = np.random.RandomState(seed)
    self.holder = [filled_cache(m, batch, capacity, depth, self.rng)]
    self.block = random_tokens(self.rng, m.cfg.vocab_size - 1, batch, gamma_max + 1)
    self.warm: set[int] = set()

  def times(self, ns: Sequence[int], reps: int = 1,
            sp: SamplingParams = SamplingParams()) -> dict[int, timing.Timing]:
    """Per-verify timings for each block size N (B <= N; a new N compiles on first use)."""
    del sp  # greedy's argmax: the rows' sampling is the accept phase's
    kvc.check_capacity([self.depth], self.gamma_max + 1, self.capacity)
    out = {}
    for n in sorted(set(ns)):
      layout = timing.block(pk.pack(self.block, jnp.asarray(
          ragged_counts(self.batch, n, self.gamma_max)), self.holder[0].lengths, n))

      def run(packed=layout):
        acc, self.holder[0] = repeat_packed(self.m.params, packed, self.holder[0],
                                            cfg=self.m.cfg, k=self.k)
        return acc

      t = timing.measure(run, reps=reps, warmup=0 if n in self.warm else 1)
      self.warm.add(n)
      out[n] = dataclasses.replace(t, times=[x / self.k for x in t.times])
    return out


@functools.partial(jax.jit, static_argnames=("sc", "k"), donate_argnames=("tcache",))
def _repeat_propose(dparams, dstate, tcache, tail, n, key, *, sc, k: int):
  """k proposals (batch of n's rows) on device; each iteration's lengths
  differ (n - i % 2, the target cache's with them), so XLA cannot hoist the
  proposal out of the loop. `tcache` (None: no target) is carried, as the
  engine's step carries it: a drafter that writes it (streaming) writes in
  place. Returns (a checksum, tcache)."""
  live = jnp.ones(n.shape, bool)
  base = None if tcache is None else tcache.lengths

  def body(i, carry):
    acc, tc = carry
    tc = None if tc is None else kvc.rollback(tc, base - i % 2)
    d, _, tc = sc.drafter.propose(dparams, dstate, tc, tail, n - i % 2, live,
                                  jax.random.fold_in(key, i), sc)
    return acc + jnp.sum(d.tokens) + jnp.sum(d.n_drafted), tc

  acc, tcache = jax.lax.fori_loop(0, k, body, (jnp.int32(0), tcache))
  return acc, None if tcache is None else kvc.rollback(tcache, base)


class ProposeProbe:
  """T_draft(1) of a drafter that is not a plain model (n-gram lookup, an
  EAGLE head, the streaming draft): the time of one whole proposal of gamma
  tokens (batch `batch` rows of one history of `depth` random tokens in
  `capacity` slots), divided by gamma; k proposals per timed repetition in
  one jitted loop. The same `times` interface as CostProbe (n must be 1).
  `target` (a Runner) is needed by drafters whose state starts from the
  target (eagle's prefill) or that read its cache (streaming): the target's
  cache then holds the history, as after the engine's prefill."""

  def __init__(self, drafter, target_cfg, gamma: int, capacity: int, depth: int, seed: int = 0,
               k: int = REPEATS, target: steps.Runner | None = None, batch: int = 1):
    self.sc = plan.SpecConfig(target_cfg, None, gamma, drafter=drafter, simulated=True)
    self.k, self.capacity, self.depth = k, capacity, depth
    rng = np.random.RandomState(seed)
    prompts = [rng.randint(0, target_cfg.vocab_size, depth - 1).tolist()] * batch
    self.dparams = self.sc.drafter.draft_params(None if target is None else target.params,
                                                None)
    self.dstate = self.sc.drafter.init(self.sc, target, self.dparams, prompts, capacity,
                                       jnp.asarray([p[-1] for p in prompts]))
    self.tcache = None if target is None else filled_cache(target, batch, capacity,
                                                           depth - 1, rng)
    self.tail = jnp.asarray([[p[-1], p[-1]] for p in prompts], jnp.int32)
    self.n = jnp.full((batch,), depth, jnp.int32)
    self.warm = False

  def times(self, ns: Sequence[int], reps: int = 1,
            sp: SamplingParams = SamplingParams()) -> dict[int, timing.Timing]:
    del sp  # a deterministic proposal does not depend on the sampling settings
    if set(ns) != {1}:
      raise ValueError(f"ProposeProbe times T_draft(1) only, asked for {sorted(set(ns))}")

    def run():
      acc, self.tcache = _repeat_propose(self.dparams, self.dstate, self.tcache, self.tail,
                                         self.n, jax.random.PRNGKey(0), sc=self.sc, k=self.k)
      return acc

    t = timing.measure(run, reps=reps, warmup=0 if self.warm else 1)
    self.warm = True
    per = self.k * self.sc.gamma
    return {1: dataclasses.replace(t, times=[x / per for x in t.times])}


def draft_probe(drafter, target: steps.Runner, draft: steps.Runner | None, gamma: int,
                capacity: int, depth: int, batch: int = 1, k: int = REPEATS):
  """The probe of T_draft(1) for a drafter: a CostProbe of the model it runs
  (the draft model, or the target's layer subset), otherwise (ngram, eagle)
  a ProposeProbe of its whole proposal per token, at batch 1; the streaming
  draft's at batch `batch` (it reads the batch's shared cache)."""
  if isinstance(drafter, (draft_model.ModelDrafter, draft_model.LayerSkipDrafter)):
    cfg = drafter.draft_config(target.cfg, draft and draft.cfg)
    return CostProbe(steps.Runner(cfg, drafter.draft_params(target.params, draft)), capacity,
                     depth, k=k, batch=batch)
  batch = batch if drafter.reads_batch_cache else 1
  return ProposeProbe(drafter, target.cfg, gamma, capacity, depth, k=k, target=target,
                      batch=batch)


@functools.partial(jax.jit, static_argnames=("sc", "k"))
def _repeat_accept(key, accept_probs, p, drafted, tail, n, out, *, sc, k: int):
  """k accept phases with their bookkeeping (keep_tokens, commit's length
  arithmetic), on device."""
  b = tail.shape[0]
  live = jnp.ones((b,), bool)

  def body(i, carry):
    acc, out = carry
    j = sc.step.judge(jax.random.fold_in(key, i), accept_probs, p, drafted, tail, n, live, sc)
    out, count, _, kept = speculative.keep_tokens(out, jnp.ones((b,), jnp.int32), ~live,
                                                  j, -1, out.shape[1])
    return acc + jnp.sum(count + kept + j.t_len + j.d_len), out

  return jax.lax.fori_loop(0, k, body, (jnp.int32(0), out))


def accept_cost(sc: plan.SpecConfig, reps: int, seed: int = 0,
                k: int = REPEATS, batch: int = 1) -> timing.Timing:
  """Time of one accept phase and its bookkeeping (batch `batch`, 1 by
  default) for `sc`'s rule kind, gamma and sampling settings, on random
  distributions; per phase."""
  v, gamma, b = sc.target.vocab_size, sc.gamma, batch
  keys = jax.random.split(jax.random.PRNGKey(seed), 4)
  p = jax.nn.softmax(4 * jax.random.normal(keys[0], (b, gamma + 1, v)), -1)
  q = jax.nn.softmax(4 * jax.random.normal(keys[1], (b, gamma, v)), -1)
  drafted = Drafted(
      tokens=jax.random.randint(keys[2], (b, gamma), 0, v),
      q=q if sc.needs_q else q[..., :0], n_drafted=jnp.full((b,), gamma, jnp.int32),
      caught_up=jnp.zeros((b,), bool))
  tail, n = jnp.zeros((b, 2), jnp.int32), jnp.full((b,), 8, jnp.int32)
  out = jnp.zeros((b, 4 * (gamma + 1)), jnp.int32)
  probs = jnp.full((gamma,), 0.5)
  run = lambda: _repeat_accept(keys[3], probs, p, drafted, tail, n, out, sc=sc, k=k)
  t = timing.measure(run, reps=max(reps, 5))
  return dataclasses.replace(t, times=[x / k for x in t.times])


def _stand_in_parents(tree) -> np.ndarray:
  """Parents [N] of a tree of `tree`'s shape: a static tree's own; for a
  dynamic one (per-row topology), BFS with up to `width` children per node
  and `max_depth` levels, N nodes: what its judge walks at most."""
  if getattr(tree, "parents", None) is not None:
    return np.asarray(tree.parents, np.int32)
  parents, depth, frontier = [], [], [-1]
  while len(parents) < tree.n:
    nxt = []
    for u in frontier:
      for _ in range(tree.width):
        if len(parents) == tree.n:
          break
        parents.append(u)
        depth.append(1 if u < 0 else depth[u] + 1)
        if depth[-1] < tree.max_depth:
          nxt.append(len(parents) - 1)
    frontier = nxt or frontier
  return np.asarray(parents, np.int32)


def tree_accept_cost(sc: plan.SpecConfig, tree, reps: int, seed: int = 0,
                     k: int = REPEATS, batch: int = 1) -> timing.Timing:
  """Time of one token tree's accept phase (tree_acceptance.judge_tree through
  the tree step's judge) and its bookkeeping (keep_tokens), for `sc`'s rule
  kind, sampling settings and drafter, on random [B, 1+N, V] distributions;
  per phase. `tree`: a static tree, or a dynamic one (judged on a stand-in
  topology of its shape: _stand_in_parents). accept_cost prices a chain."""
  sc = dataclasses.replace(sc, gamma=tree.max_depth, tree=tree)
  v, n, b, d = sc.target.vocab_size, tree.n, batch, tree.max_depth
  keys = jax.random.split(jax.random.PRNGKey(seed), 4)
  p = jax.nn.softmax(4 * jax.random.normal(keys[0], (b, n + 1, v)), -1)
  q = jax.nn.softmax(4 * jax.random.normal(keys[1], (b, n + 1, v)), -1)
  dynamic = getattr(tree, "parents", None) is None
  rows = lambda x: jnp.broadcast_to(jnp.asarray(x)[None], (b, *np.shape(x)))
  drafted = DraftedTree(
      tokens=jax.random.randint(keys[2], (b, n), 0, v), q=q if sc.needs_q else q[..., :0],
      caught_up=jnp.zeros((b,), bool),
      parents=rows(_stand_in_parents(tree)) if dynamic else None,
      fed=rows(np.arange(n + 1, dtype=np.int32)) if dynamic else None)
  tail, n_len = jnp.zeros((b, 2), jnp.int32), jnp.full((b,), 8, jnp.int32)
  out = jnp.zeros((b, 4 * (d + 1)), jnp.int32)
  probs = jnp.full((d, tree.width), 0.5)
  run = lambda: _repeat_accept(keys[3], probs, p, drafted, tail, n_len, out, sc=sc, k=k)
  t = timing.measure(run, reps=max(reps, 5))
  return dataclasses.replace(t, times=[x / k for x in t.times])
