"""A sweep's rows prefilled once: `MemoRunner`, a steps.Runner whose
prefill of an empty cache looks each of the sweep's rows up, alone, by
(row, capacity, hidden layers), and stacks them into the batch. The rows
are the prompts and a large batch's cut rows (points.distinct_rows).

Every point of a sweep runs the same rows, several times (warm-up,
repetitions, target-only beside each drafter, every batch and gamma), and
each run used to prefill them again. A 3.9 K row's prefill on 2 CPU cores
takes about 20 s (in chunks; 41 s in one pass), more than the decode the
sweep measures. Decoding reads only the slots below each row's length, so
a row's cache prefilled alone is the batch's row (its padding past the
length differs, and is overwritten before it is read). Every run of a
sweep starts from the same rows, target-only and speculative alike.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.model import sharding
from specjax.model import steps


def stack(rows):
  """Batch-1 pytrees stacked into one batch: new buffers (a run donates its
  cache; the memo keeps its own)."""
  if len(rows) == 1:
    return jax.tree.map(jnp.copy, rows[0])
  return jax.tree.map(lambda *xs: jnp.concatenate(xs, 0), *rows)


def pad_hidden(h: jax.Array, width: int) -> jax.Array:
  """A row's hidden states [1, Tb, E] padded (zeros) or cut to the batch's
  bucket `width` (past its prompt's length they are padding either way)."""
  if h.shape[1] >= width:
    return h[:, :width]
  return jnp.pad(h, ((0, 0), (0, width - h.shape[1]), (0, 0)))


def memo_key(row: tuple, capacity: int, layers: tuple) -> tuple:
  """What a memoised row is: its prompt, the cache's capacity, and which
  hidden states came with it ((return_hidden, hidden_layers))."""
  return (row, capacity, layers)


@dataclasses.dataclass(frozen=True)
class MemoRunner(steps.Runner):
  """steps.Runner with the sweep's rows (`prompts`) prefilled once each
  (module docstring). Other rows, a cache already holding tokens, and a sharded
  cache take Runner.prefill. The memo keeps one capacity's rows (a sweep of
  contexts moves from one to the next)."""
  prompts: frozenset = frozenset()
  memo: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

  @classmethod
  def wrap(cls, runner: steps.Runner, prompts) -> "MemoRunner":
    return cls(runner.cfg, runner.params, frozenset(tuple(p) for p in prompts))

  def prefill(self, prompts, cache, return_hidden: bool = False,
              hidden_layers: tuple[int, ...] | None = None):
    rows = [tuple(p) for p in prompts]
    if (not rows or len(rows) != cache.batch or not set(rows) <= self.prompts
        or sharding.cache_sharding(self.params, cache.batch) is not None
        or sharding.to_host(cache.lengths).any()):
      return super().prefill(prompts, cache, return_hidden, hidden_layers)
    layers = (return_hidden, hidden_layers)
    if any(k[1] != cache.capacity for k in self.memo):
      self.memo.clear()
    outs = [self._row(r, cache.capacity, layers) for r in rows]
    logits, kv = stack([o[0] for o in outs]), stack([o[1] for o in outs])
    if not return_hidden:
      return logits, kv
    width = min(steps.prefill_bucket(max(map(len, rows))), cache.capacity)
    return logits, kv, stack([pad_hidden(o[2], width) for o in outs])

  def _row(self, row: tuple, capacity: int, layers: tuple):
    key = memo_key(row, capacity, layers)
    if key not in self.memo:
      out = super().prefill([list(row)], self.new_cache(1, capacity), *layers)
      self.memo[key] = jax.block_until_ready(out)
    return self.memo[key]


def wrap(runner: steps.Runner | None, prompts) -> MemoRunner | None:
  """`runner` with `prompts` prefilled once each (None stays None)."""
  return None if runner is None else MemoRunner.wrap(runner, prompts)

