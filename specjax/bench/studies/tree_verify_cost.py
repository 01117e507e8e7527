"""The verify cost with a tree mask, T(B, N): one target forward over a token
tree's block of 1 + N tokens per row (each node at position length + depth,
attending to the cache and its own ancestors), in XLA and in PyTorch, so the
two engines' verify surfaces compare for trees as for chains (issue 25).
  XlaTreeProbe    steps.tree_verify k times in one jitted loop from the same
                  cache state, logits consumed, time per verify (CostProbe's shape)
  TorchTreeProbe  backends/torch_llama.TorchLlama.step with the tree's mask
                  and depths, k host calls per repetition
  surface         T(B, N) per batch and tree, rows {batch, nodes, tree, seconds}
A tree and a chain of one block size time alike (same shapes, another mask);
on a GPU the verify stays flat until B (1 + N) nears the ridge point, where
trees should win. docs/trees.md.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.decode import probes
from specjax.metrics import timing
from specjax.model import kv_cache as kvc
from specjax.model import steps
from specjax.model import tree as trees


@functools.partial(jax.jit, static_argnames=("cfg", "k"), donate_argnames=("cache",))
def _repeat_tree_verify(params, tokens, mask, cache: kvc.KVCache, cfg, k: int):
  """k tree verifies from the same cache state (tree_verify keeps the
  lengths), each followed by the argmax of its logits."""

  def body(i, carry):
    c, acc = carry
    logits, c = steps.tree_verify(params, tokens, mask, c, cfg)
    return c, acc + jnp.sum(jnp.argmax(logits, -1), -1)

  return jax.lax.fori_loop(0, k, body, (cache, jnp.zeros(tokens.shape[:1], jnp.int32)))


class XlaTreeProbe:
  """T(B, 1 + N) of specjax's tree verify at batch `batch`, a cache of
  `capacity` slots holding `depth` random tokens per row."""

  def __init__(self, m: steps.Runner, batch: int, capacity: int, depth: int, seed: int = 0,
               k: int = probes.REPEATS):
    self.m, self.batch, self.capacity, self.depth, self.k = m, batch, capacity, depth, k
    self.rng = np.random.RandomState(seed)
    self.holder = [probes.filled_cache(m, batch, capacity, depth, self.rng)]
    self.warm: set = set()

  def times(self, tree_list: Sequence[trees.Tree], reps: int = 3) -> dict[str, timing.Timing]:
    kvc.check_capacity([self.depth], max(t.block_size for t in tree_list), self.capacity)
    out = {}
    for t in tree_list:
      tokens = probes.random_tokens(self.rng, self.m.cfg.vocab_size, self.batch, t.block_size)
      mask = jnp.asarray(t.mask())

      def run(tokens=tokens, mask=mask):
        self.holder[0], acc = _repeat_tree_verify(self.m.params, tokens, mask, self.holder[0],
                                                  cfg=self.m.cfg, k=self.k)
        return acc

      first = t.block_size not in self.warm
      self.warm.add(t.block_size)
      r = timing.measure(run, reps=reps, warmup=1 if first else 0)
      out[t.spec] = dataclasses.replace(r, times=[x / self.k for x in r.times])
    return out


def torch_tree(t: trees.Tree, torch):
  """(mask [T, T] bool, depths [T] int64) tensors of a tree, for TorchLlama."""
  return (torch.from_numpy(t.mask()), torch.from_numpy(t.block_depths().astype(np.int64)))


class TorchTreeProbe:
  """T(B, 1 + N) of the PyTorch engine's tree verify (TorchLlama.step with
  the tree), `k` forwards per repetition from the same lengths."""

  def __init__(self, m, batch: int, capacity: int, depth: int, seed: int = 0,
               k: int = probes.REPEATS):
    self.m, self.batch, self.capacity, self.depth, self.k = m, batch, capacity, depth, k
    self.rng = np.random.RandomState(seed)
    self.cache = m.new_cache(batch, capacity)
    if depth:
      m.prefill(self.rng.randint(0, m.cfg.vocab_size, (batch, depth)).tolist(), self.cache)

  def times(self, tree_list: Sequence[trees.Tree], reps: int = 3) -> dict[str, timing.Timing]:
    torch = self.m.torch
    kvc.check_capacity([self.depth], max(t.block_size for t in tree_list), self.capacity)
    out = {}
    for t in tree_list:
      tokens = torch.from_numpy(self.rng.randint(0, self.m.cfg.vocab_size,
                                                 (self.batch, t.block_size)))
      tt = torch_tree(t, torch)

      def run(tokens=tokens, tt=tt):
        for _ in range(self.k):
          self.cache.lengths.fill_(self.depth)
          self.m.step(tokens, self.cache, tree=tt)

      t0 = time.perf_counter()
      run()  # warm-up (torch.compile traces a new shape)
      warm_s = time.perf_counter() - t0
      times = []
      for _ in range(reps):
        t0 = time.perf_counter()
        run()
        times.append((time.perf_counter() - t0) / self.k)
      out[t.spec] = timing.Timing(times=times, compile_s=warm_s)
    return out


def surface(make_probe, batches: Sequence[int], tree_list: Sequence[trees.Tree],
            reps: int = 3) -> list[dict]:
  """T(B, N) rows for every batch (make_probe(batch) -> a probe) and tree."""
  rows = []
  for b in batches:
    probe = make_probe(b)
    for t, r in zip(tree_list, probe.times(tree_list, reps).values()):
      rows.append({"batch": int(b), "nodes": t.n, "tree": t.spec, "chain": t.is_chain,
                   "seconds": r.median})
  return rows
