"""Prompt lookup (n-gram) drafting: no model, the continuation of the latest
earlier match of the row's last n tokens, on device at fixed shapes."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.base import Drafted, Drafter




@dataclasses.dataclass(frozen=True)
class NgramDrafter(Drafter):
  """Prompt lookup: the continuation of the latest earlier match of the
  row's last n tokens (n = n_max down to n_min), on device, fixed shapes."""
  n_min: int = 1
  n_max: int = 4
  kind: ClassVar[str] = "ngram"
  deterministic: ClassVar[bool] = True

  @property
  def spec(self) -> str:
    return f"ngram:{self.n_min}-{self.n_max}"

  def draft_config(self, target, draft):
    return None

  def draft_params(self, tparams, draft):
    return None

  def init(self, sc, target, dparams, prompts, capacity, first):
    """The token history [B, capacity]: prompt and first token (its length is
    SpecState.n)."""
    hist = np.zeros((len(prompts), capacity), np.int32)
    first = np.asarray(first)
    for b, p in enumerate(prompts):
      hist[b, :len(p)] = p
      hist[b, len(p)] = first[b]
    return jnp.asarray(hist)

  def propose(self, dparams, dstate, tcache, tail, n, live, key, sc):
    tokens, n_drafted = ngram_propose(dstate, n, sc.gamma, self.n_min, self.n_max)
    b = n.shape[0]
    return Drafted(tokens=tokens, q=jnp.zeros((b, sc.gamma, 0), jnp.float32),
                   n_drafted=jnp.where(live, n_drafted, 0),
                   caught_up=jnp.zeros((b,), bool)), dstate, tcache

  def commit(self, dstate, c):
    # emitted lands at n_prev..; only the first `kept` lie inside the new
    # length n. A finished row is left alone (its write could run past the
    # capacity, where dynamic_update_slice would clamp it onto its history).
    write = jax.vmap(lambda h, e, at: jax.lax.dynamic_update_slice(h, e, (at,)))
    return jnp.where(c.live[:, None], write(dstate, c.emitted, c.n_prev), dstate)


def ngram_propose(hist, n, gamma: int, n_min: int, n_max: int):
  """Prompt lookup over hist [B, S] (row b's history is hist[b, :n[b]]).

  For each n-gram size m (the largest one that matches wins), the key is the
  row's last m tokens; a match is a start j with hist[j:j+m] == key and
  j + m < n (strictly earlier than the key itself, at least one token after
  it); the latest match proposes hist[j+m : j+m+gamma], cut at the end of
  the history. Returns (tokens [B, gamma] (0 past n_drafted), n_drafted [B]).
  """
  b, s = hist.shape
  idx = jnp.arange(s)[None, :]                      # [1, S] candidate starts j
  best_j = jnp.full((b,), -1, jnp.int32)
  best_m = jnp.zeros((b,), jnp.int32)
  for m in range(n_min, n_max + 1):                 # a larger m overrides
    key_pos = jnp.clip(n[:, None] - m + jnp.arange(m)[None, :], 0, s - 1)
    key = jnp.take_along_axis(hist, key_pos, 1)     # [B, m]
    ok = (idx + m < n[:, None]) & (n[:, None] > m)  # [B, S]
    for i in range(m):  # hist[b, j + i] == key[b, i]
      shifted = jnp.pad(hist[:, i:], ((0, 0), (0, i)), constant_values=-1)
      ok = ok & (shifted == key[:, i:i + 1])
    j = jnp.max(jnp.where(ok, idx, -1), 1).astype(jnp.int32)
    found = j >= 0
    best_j = jnp.where(found, j, best_j)
    best_m = jnp.where(found, m, best_m)
  start = best_j + best_m                           # first proposed position
  n_drafted = jnp.where(best_j >= 0, jnp.clip(n - start, 0, gamma), 0).astype(jnp.int32)
  pos = jnp.arange(gamma)[None, :]
  tokens = jnp.take_along_axis(hist, jnp.clip(start[:, None] + pos, 0, s - 1), 1)
  return jnp.where(pos < n_drafted[:, None], tokens, 0).astype(jnp.int32), n_drafted
