"""What the packed verify costs against the rectangular one: T_packed(B, N)
(steps.packed_verify over a block of N tokens, model/packed.py) next to
T_rect(B, gamma + 1) (today's verify of every row's gamma + 1 tokens) and
T_rect(B, N / B) (a rectangle of the same token count, where B divides N).
Each time is k calls inside one jitted loop from the same cache (no host
dispatch), the logits consumed by an argmax; the kinds alternate within each
repetition so that drift in the machine's load hits all alike; medians,
compile untimed. docs/packed_verify.md."""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.decode.probes import ragged_counts, repeat_packed
from specjax.metrics import timing
from specjax.model import kv_cache as kvc
from specjax.model import llama as model
from specjax.model import packed as pk
from specjax.model import steps

REPEATS = 4  # verifies per timed call


@functools.partial(jax.jit, static_argnames=("cfg", "k"), donate_argnames=("cache",))
def repeat_rect(params, tokens, cache: kvc.KVCache, cfg, k: int):
  """k rectangular verifies of tokens [B, T] from the same cache state."""
  depth = cache.lengths

  def body(i, carry):
    c, acc = carry
    logits, c = model.forward(params, tokens + i % 2, c, cfg)
    return kvc.rollback(c, depth), acc + jnp.sum(jnp.argmax(logits, -1))

  cache, acc = jax.lax.fori_loop(0, k, body, (cache, jnp.int32(0)))
  return acc, cache


def packed_cost(target: steps.Runner, batches: Sequence[int], gamma: int, depth: int,
                reps: int, log: Callable[[str], None] = print) -> list[dict]:
  """One record per (batch, N), N = B .. B (gamma + 1) by B / 2: T_packed(B, N),
  T_rect(B, gamma + 1), T_rect(B, N / B) where B divides N, their ratios."""
  cfg, params, rng = target.cfg, target.params, np.random.RandomState(0)
  capacity = kvc.round_capacity(depth + gamma + 2)
  recs = []
  for batch in batches:
    prompts = rng.randint(0, cfg.vocab_size, (batch, depth)).tolist()
    cache = [timing.block(target.prefill(prompts, target.new_cache(batch, capacity))[1])]
    block = jnp.asarray(rng.randint(0, cfg.vocab_size - 1, (batch, gamma + 1)), jnp.int32)
    sizes = range(batch, batch * (gamma + 1) + 1, max(1, batch // 2))

    def run_rect(t):
      acc, cache[0] = repeat_rect(params, block[:, :t], cache[0], cfg=cfg, k=REPEATS)
      return acc

    def run_packed(packed):
      acc, cache[0] = repeat_packed(params, packed, cache[0], cfg=cfg, k=REPEATS)
      return acc

    layout = lambda n: timing.block(pk.pack(block, jnp.asarray(ragged_counts(batch, n, gamma)),
                                            cache[0].lengths, n))  # untimed
    runs = {("rect", t): functools.partial(run_rect, t) for t in range(1, gamma + 2)}
    runs.update({("packed", n): functools.partial(run_packed, layout(n)) for n in sizes})
    times = {key: [] for key in runs}
    for key, run in runs.items():  # compile and warm up, untimed
      timing.block(run())
    for _ in range(reps):
      for key, run in runs.items():
        times[key].append(timing.measure(run, reps=1, warmup=0).median / REPEATS)
    med = {key: float(np.median(v)) for key, v in times.items()}
    full = med["rect", gamma + 1]
    for n in sizes:
      same = med.get(("rect", n // batch)) if n % batch == 0 else None
      recs.append({"batch": batch, "n_tokens": n, "gamma": gamma, "depth": depth,
                   "t_packed_s": med["packed", n], "t_rect_full_s": full,
                   "t_rect_same_s": same, "ratio_full": med["packed", n] / full,
                   "ratio_same": None if same is None else med["packed", n] / same,
                   "reps": reps, "repeats": REPEATS})
      log(f"B {batch} N {n:3d}: packed {1e3 * med['packed', n]:7.2f} ms, rect(B, {gamma + 1}) "
          f"{1e3 * full:7.2f} ms (x{recs[-1]['ratio_full']:.2f})"
          + ("" if same is None else
             f", rect(B, {n // batch}) {1e3 * same:7.2f} ms (x{recs[-1]['ratio_same']:.2f})"))
  return recs
