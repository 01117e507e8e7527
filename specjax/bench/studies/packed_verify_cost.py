"""What the packed verify costs against the rectangular one: T_packed(B, N)
(steps.packed_verify over a block of N tokens, model/packed.py) next to
T_rect(B, gamma + 1) (today's verify of every row's gamma + 1 tokens) and
T_rect(B, N / B) (a rectangle of the same token count, where B divides N).
Each time is k calls inside one jitted loop from the same cache (no host
dispatch), the logits consumed by an argmax; the kinds alternate within each
repetition so that drift in the machine's load hits all alike; medians,
compile untimed. With a TorchLlama on the same weights, the same three in
PyTorch (backends/torch_packed.py: the flattened layout under a
block-diagonal mask), timed in the same rounds. docs/packed_verify.md."""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.bench.backends import torch_packed
from specjax.decode.probes import ragged_counts, repeat_packed
from specjax.errors import ConfigError
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


def even_sizes(batch: int, gamma: int) -> list[int]:
  """N = B .. B (gamma + 1) by B / 2: the block sizes a budget may take."""
  return list(range(batch, batch * (gamma + 1) + 1, max(1, batch // 2)))


def rectangles(batch: int, gamma: int, ns: Sequence[int]) -> set[int]:
  """The rectangles' widths the records of blocks of `ns` tokens use: gamma
  + 1 and, where B divides N, N / B."""
  return {gamma + 1} | {n // batch for n in ns if n % batch == 0}


def packed_cost(target: steps.Runner, batches: Sequence[int], gamma: int, depth: int,
                reps: int, log: Callable[[str], None] = print, torch_model=None,
                sizes: Callable[[int, int], Sequence[int]] = even_sizes) -> list[dict]:
  """One record per (batch, N), N in sizes(B, gamma): T_packed(B, N),
  T_rect(B, gamma + 1), T_rect(B, N / B) where B divides N, their ratios;
  with torch_model (a TorchLlama on the same weights) the same three in
  PyTorch (torch_packed.py's flattened layout), timed in the same rounds.
  Only the rectangles a record uses are compiled (a 7B shape takes seconds:
  `rectangles`). A round runs the kinds by token count, so that the
  kinds compared at one count run back to back."""
  cfg, rng = target.cfg, np.random.RandomState(0)
  capacity = kvc.round_capacity(depth + gamma + 2)
  recs = []
  for batch in batches:
    prompts = rng.randint(0, cfg.vocab_size, (batch, depth)).tolist()
    block = rng.randint(0, cfg.vocab_size - 1, (batch, gamma + 1))
    ns = sorted(set(sizes(batch, gamma)))
    if not ns or ns[0] < batch or ns[-1] > batch * (gamma + 1):
      raise ConfigError(f"block sizes {ns} at batch {batch}: each must lie in "
                        f"[{batch}, {batch * (gamma + 1)}] (a tail a row, gamma drafts at most)")
    runs = xla_runs(target, prompts, block, ns, capacity)
    if torch_model is not None:
      runs.update(torch_runs(torch_model, prompts, block, ns, capacity))
    rects = rectangles(batch, gamma, ns)
    tokens = lambda key: key[1] * batch if key[0].endswith("rect") else key[1]
    med = median_times({key: run for key, run in sorted(runs.items(), key=lambda r: tokens(r[0]))
                        if not key[0].endswith("rect") or key[1] in rects}, reps)
    for n in ns:
      recs.append(record(med, batch, n, gamma, depth, reps))
      log(summary(recs[-1]))
  return recs


def xla_runs(target: steps.Runner, prompts, block, sizes, capacity) -> dict:
  """{("rect", t) for t = 1 .. T, ("packed", n) for n in sizes: a timed call
  of REPEATS verifies in one jitted loop} on one cache holding the prompts."""
  cfg, params, (batch, t_max) = target.cfg, target.params, block.shape
  cache = [timing.block(target.prefill(prompts, target.new_cache(batch, capacity))[1])]
  block = jnp.asarray(block, jnp.int32)

  def run_rect(t):
    acc, cache[0] = repeat_rect(params, block[:, :t], cache[0], cfg=cfg, k=REPEATS)
    return acc

  def run_packed(packed):
    acc, cache[0] = repeat_packed(params, packed, cache[0], cfg=cfg, k=REPEATS)
    return acc

  gamma = t_max - 1
  layout = lambda n: timing.block(pk.pack(block, jnp.asarray(ragged_counts(batch, n, gamma)),
                                          cache[0].lengths, n))  # untimed
  runs = {("rect", t): functools.partial(run_rect, t) for t in range(1, t_max + 1)}
  runs.update({("packed", n): functools.partial(run_packed, layout(n)) for n in sizes})
  return runs


def torch_runs(m, prompts, block, sizes, capacity) -> dict:
  """{("torch rect", t), ("torch mask", n), ("torch rows", n)}: REPEATS
  forwards of a TorchLlama (each a host call, lengths set back) from one
  cache holding the prompts, the argmax consumed; the packed verify under
  its dense block-diagonal mask and row by row (torch_packed.ATTENTION)."""
  torch, (batch, t_max) = m.torch, block.shape
  cache = m.new_cache(batch, capacity)
  m.prefill(prompts, cache)
  depth = cache.lengths.clone()
  block = torch.from_numpy(block)

  def repeat(call, arg):
    acc = 0
    for _ in range(REPEATS):
      cache.lengths.copy_(depth)
      acc += int(call(arg, cache).sum())
    return acc

  runs = {("torch rect", t): functools.partial(repeat, m.step, block[:, :t])
          for t in range(1, t_max + 1)}
  layout = lambda n: torch_packed.flatten(block, ragged_counts(batch, n, t_max - 1), depth, n)
  for attention in torch_packed.ATTENTION:
    verify = torch_packed.TorchPackedVerify(m, attention)
    runs.update({("torch " + attention, n): functools.partial(repeat, verify.step, layout(n))
                 for n in sizes})
  return runs


def median_times(runs: dict, reps: int) -> dict:
  """Seconds per verify of every run: each warmed up once (compile untimed),
  then `reps` rounds running every kind in turn (drift hits all alike), medians."""
  times = {key: [] for key in runs}
  for run in runs.values():
    timing.block(run())
  for _ in range(reps):
    for key, run in runs.items():
      times[key].append(timing.measure(run, reps=1, warmup=0).median / REPEATS)
  return {key: float(np.median(v)) for key, v in times.items()}


ENGINES = (("", "packed", "rect"),  # record suffix, run kinds: packed, rectangle
           ("_torch", "torch mask", "torch rect"), ("_torch_rows", "torch rows", "torch rect"))


def record(med: dict, batch: int, n: int, gamma: int, depth: int, reps: int) -> dict:
  """The record of (batch, n): each engine's packed time, its rectangles at
  gamma + 1 and (where B divides n) n / B tokens a row, their ratios (None
  for an engine not timed), and torch's packed times over XLA's."""
  out = {"batch": batch, "n_tokens": n, "gamma": gamma, "depth": depth, "reps": reps,
         "repeats": REPEATS}
  for engine, packed_kind, rect_kind in ENGINES:
    packed = med.get((packed_kind, n))
    full = med.get((rect_kind, gamma + 1))
    same = med.get((rect_kind, n // batch)) if n % batch == 0 else None
    out.update({f"t_packed{engine}_s": packed, f"t_rect_full{engine}_s": full,
                f"t_rect_same{engine}_s": same,
                f"ratio_full{engine}": None if packed is None else packed / full,
                f"ratio_same{engine}": None if packed is None or same is None else packed / same})
    if engine:
      xla = out["t_packed_s"]
      out[f"{engine[1:]}_over_xla"] = None if packed is None or xla is None else packed / xla
  return out


def summary(r: dict) -> str:
  """One line of a record: each engine's T_packed and its rectangles (ms)."""
  parts = [f"B {r['batch']} N {r['n_tokens']:3d}:"]
  for engine, packed_kind, _ in ENGINES:
    if r[f"t_packed{engine}_s"] is None:
      continue
    name = "xla packed" if not engine else packed_kind
    line = (f" {name} {1e3 * r[f't_packed{engine}_s']:7.2f} ms / rect(B, {r['gamma'] + 1}) "
            f"x{r[f'ratio_full{engine}']:.2f}")
    if r[f"t_rect_same{engine}_s"] is not None:
      line += f" / rect(B, {r['n_tokens'] // r['batch']}) x{r[f'ratio_same{engine}']:.2f}"
    if r.get(f"{engine[1:]}_over_xla") is not None:
      line += f" / xla x{r[f'{engine[1:]}_over_xla']:.2f}"
    parts.append(line + ";")
  return "".join(parts)
