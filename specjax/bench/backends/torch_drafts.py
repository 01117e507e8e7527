"""The drafts of torch_spec.TorchSpec's greedy loop, one interface:
`new_state(batch, capacity)` (the draft's own state, or None),
`prefill(prompts, state)`, `draft(tail, n, state, tcache, gamma, live)` ->
(drafts [B, gamma], behind [B]: rows that were caught up first) and
`commit(state, length)`. `TorchModelDraft` is a draft model on a cache of
its own; `TorchStreamingDraft` the streaming self-draft on the target's
cache (drafters/streaming.py; exact against it:
tests/bench/test_torch_streaming.py). `TorchDraftProbe` times the latter's
proposal for the cost surface.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from specjax.bench.backends.torch_llama import Cache, TorchLlama, window_slots
from specjax.metrics import timing

REPEATS = 8  # forwards (proposals) per timed repetition of a probe (probes.REPEATS)


class TorchModelDraft:
  """A draft model (TorchLlama) on a cache of its own: a row whose cache is
  one token behind (its last step kept every draft) feeds d_gamma first,
  then gamma decode steps; commit sets its kept length."""

  def __init__(self, model: TorchLlama):
    self.model, self.cfg = model, model.cfg

  def new_state(self, batch: int, capacity: int) -> Cache:
    return self.model.new_cache(batch, capacity)

  def prefill(self, prompts, state: Cache) -> None:
    self.model.prefill(prompts, state)

  def draft(self, tail, n, state: Cache, tcache: Cache, gamma: int, live):
    del tcache
    torch = self.model.torch
    live_np = live.numpy()
    behind = live & (state.lengths < n - 1)
    if bool(behind.any()):
      state.lengths.copy_(n - 2)  # a row not behind rewrites its own slot n - 2
      self.model.step(tail[:, :1], state, live_np)
    tok, drafts = tail[:, 1], []
    for _ in range(gamma):
      tok = self.model.step(tok[:, None], state, live_np)[:, 0]
      drafts.append(tok)
    return torch.stack(drafts, 1), behind

  def commit(self, state: Cache, length) -> None:
    state.lengths.copy_(length)


class TorchStreamingDraft:
  """drafters/streaming.py's self-draft in torch, greedy chains: the target's
  weights on the target's own cache, fed index f written at slot n - 1 + f,
  each fed token attending only to the first `sinks` slots, the last
  `window` kept slots and the tokens fed before it (window_slots); the
  lengths handed back as they were (the verify rewrites those slots)."""

  def __init__(self, target: TorchLlama, window: int, sinks: int = 4):
    self.target, self.window, self.sinks = target, int(window), int(sinks)
    self.cfg = target.cfg

  def new_state(self, batch: int, capacity: int) -> None:
    return None  # the target's cache is the draft's

  def prefill(self, prompts, state) -> None:
    del prompts, state

  def draft(self, tail, n, state, tcache: Cache, gamma: int, live):
    """The loop's draft phase: tcache at the kept length n - 1, never behind."""
    del n, state
    return self.propose(tail[:, 1], tcache, gamma), self.target.torch.zeros_like(live)

  def commit(self, state, length) -> None:
    del state, length

  def propose(self, last, cache: Cache, gamma: int, logits: bool = False):
    """gamma greedy drafts [B, gamma] after `last` [B] (the step's tail, at
    slot lengths); with `logits`, also each feed's f32 logits [B, gamma, V]
    (eager)."""
    torch = self.target.torch
    start = cache.lengths.clone()
    win = window_slots(start, min(self.sinks, cache.capacity), min(self.window, cache.capacity),
                       gamma, cache.capacity)
    tok, drafts, outs = last, [], []
    for _ in range(gamma):
      if logits:
        out = self.target.logits(tok[:, None], cache, window=win)
        outs.append(out[:, 0])
        tok = torch.argmax(out[:, 0], -1)
      else:
        tok = self.target.step(tok[:, None], cache, window=win)[:, 0]
      drafts.append(tok)
    cache.lengths.copy_(start)
    drafts = torch.stack(drafts, 1)
    return (drafts, torch.stack(outs, 1)) if logits else drafts


class ProposalProbe:
  """T_draft(1) of a torch draft: k whole proposals of gamma tokens per timed
  repetition (`propose_once`, a subclass's), the first call untimed as the
  warm-up, time per drafted token (probes.ProposeProbe's shape; each
  forward a host call)."""
  gamma: int
  k: int
  warm: bool = False

  def propose_once(self) -> None:
    raise NotImplementedError

  def times(self, ns: Sequence[int], reps: int = 3) -> dict[int, timing.Timing]:
    if set(ns) != {1}:
      raise ValueError(f"{type(self).__name__} times T_draft(1) only, asked for "
                       f"{sorted(set(ns))}")

    def run():
      for _ in range(self.k):
        self.propose_once()

    warm_s = 0.0
    if not self.warm:
      warm_s, self.warm = timing.timed(run)[1], True
    times = [timing.timed(run)[1] / (self.k * self.gamma) for _ in range(reps)]
    return {1: timing.Timing(times=times, compile_s=warm_s)}


class TorchDraftProbe(ProposalProbe):
  """ProposalProbe of the torch streaming draft at batch `batch`, on a cache
  of random K/V holding `depth` tokens per row (the target's n - 1)."""

  def __init__(self, draft: TorchStreamingDraft, batch: int, capacity: int, depth: int,
               gamma: int, seed: int = 0, k: int = REPEATS):
    self.draft, self.gamma, self.k = draft, gamma, k
    self.cache = draft.target.random_cache(batch, capacity, depth - 1, seed)
    rng = np.random.RandomState(seed)
    self.last = draft.target.torch.from_numpy(
        rng.randint(0, draft.target.cfg.vocab_size, (batch,)))

  def propose_once(self) -> None:
    self.draft.propose(self.last, self.cache, self.gamma)
