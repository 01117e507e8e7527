"""Batched greedy speculative decoding in PyTorch, on the weights of an HF
`LlamaForCausalLM` through torch_llama.py's `TorchLlama` (the PyTorch side of
the XLA-vs-PyTorch comparison at batch > 1). `TorchSpec` runs, at batch B
with ragged prompts, target-only greedy generation and speculative greedy
generation (`speculative.py`'s step, phase by phase, in a host loop: draft
gamma tokens after the catch-up feed, verify gamma + 1, accept by `real` or
a simulated rule, keep at most n_predict tokens per row, commit by cache
lengths; finished rows ride along). Every row's tokens equal batch-1
target-only generation's and specjax's (tests/bench/test_torch_spec.py); the
records and statistics are specjax's. Timing (`time_point`,
`TorchCostProbe`) has the shape of the gamma sweep's (`gamma.run_group`) and
of `probes.CostProbe`, with the batch as a dimension. docs/batches.md.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Sequence

import numpy as np

from specjax.bench.backends.torch_drafts import REPEATS, TorchModelDraft
from specjax.bench.backends.torch_llama import Cache, TorchLlama, dynamo_graphs
from specjax.decode import acceptance
from specjax.decode import generation
from specjax.errors import ConfigError
from specjax.metrics import timing
from specjax.metrics.stats import Records, SpecStats
from specjax.model import kv_cache as kvc
from specjax.model.config import ModelConfig


def check_prompts(prompts, vocab_size: int) -> None:
  """Empty batch, empty prompt or an id outside the vocabulary -> ConfigError."""
  if not len(prompts):
    raise ConfigError("no prompts")
  for i, p in enumerate(prompts):
    if not len(p):
      raise ConfigError(f"prompt {i} is empty")
    bad = [t for t in p if not 0 <= int(t) < vocab_size]
    if bad:
      raise ConfigError(f"prompt {i}: token id {bad[0]} outside the vocabulary "
                        f"[0, {vocab_size})")


@dataclasses.dataclass
class TorchGenResult:
  tokens: list[list[int]]  # generated ids per row, prompt excluded
  prompt_s: float          # prefill wall time
  eval_s: float            # decode loop wall time (first token excluded)
  n_eval: int              # decode steps per row


@dataclasses.dataclass
class TorchSpecResult:
  tokens: list[list[int]]
  stats: SpecStats
  records: Records
  prompt_s: float
  eval_s: float
  n_loop: int              # loop iterations (verify calls of the batch)


class TorchSpec:
  """Target-only and speculative greedy generation at batch B (see module)."""

  def __init__(self, target: TorchLlama, draft=None):
    """draft: a draft model (TorchLlama), any torch_drafts draft, or None."""
    self.target = target
    self.draft = TorchModelDraft(draft) if isinstance(draft, TorchLlama) else draft
    if draft is not None and draft.cfg.vocab_size != target.cfg.vocab_size:
      raise ConfigError(f"draft and target vocabularies differ: {target.cfg.vocab_size} "
                        f"vs {draft.cfg.vocab_size}")
    self.torch = target.torch

  def _capacity(self, prompts, n_predict, extra, capacity):
    check_prompts(prompts, self.target.cfg.vocab_size)
    return generation.plan_capacity(self.target.cfg, max(len(p) for p in prompts),
                                    n_predict, extra=extra, capacity=capacity)

  def generate_target(self, prompts, n_predict: int, capacity: int | None = None,
                      start=None) -> TorchGenResult:
    """n_predict greedy tokens per row from the target alone; start: (the
    prompts' prefilled cache, their first tokens [B]), used in place of a
    prefill (the cache is written: hand in a copy)."""
    torch = self.torch
    cap = self._capacity(prompts, n_predict, 0, capacity)
    t0 = time.perf_counter()
    if start is None:
      cache = self.target.new_cache(len(prompts), cap)
      tok = self.target.prefill(prompts, cache)
    else:
      cache, tok = start
    prompt_s = time.perf_counter() - t0
    out = [tok]
    t0 = time.perf_counter()
    for _ in range(n_predict - 1):
      tok = self.target.step(tok[:, None], cache)[:, 0]
      out.append(tok)
    eval_s = time.perf_counter() - t0
    return TorchGenResult(torch.stack(out, 1).tolist(), prompt_s, eval_s, n_predict - 1)

  def generate(self, prompts, n_predict: int, gamma: int, rule="real", seed: int = 0,
               capacity: int | None = None, start=None) -> TorchSpecResult:
    """n_predict greedy tokens per row, speculatively (speculative.py's step);
    start: (the target's prefilled cache, the first tokens, the draft's
    prefilled state), used in place of the prefills (written: hand in copies)."""
    torch = self.torch
    if self.draft is None:
      raise ConfigError("speculative generation needs a draft model")
    if int(gamma) < 1:
      raise ConfigError(f"gamma (draft length) must be >= 1, got {gamma}")
    rule = acceptance.parse_rule(rule) if isinstance(rule, str) else rule
    rule = rule.resolve(gamma)
    probs = torch.from_numpy(acceptance.position_probs(rule, gamma))
    gen = torch.Generator().manual_seed(int(seed))
    cap = self._capacity(prompts, n_predict, gamma, capacity)
    b = len(prompts)
    t0 = time.perf_counter()
    if start is None:
      tcache, dcache = self.target.new_cache(b, cap), self.draft.new_state(b, cap)
      first = self.target.prefill(prompts, tcache)
      self.draft.prefill(prompts, dcache)
    else:
      tcache, first, dcache = start
    prompt_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    out, count, rec, n_loop = self._loop(tcache, dcache, prompts, first, n_predict, gamma,
                                         rule.simulated, probs, gen)
    eval_s = time.perf_counter() - t0
    tokens = [out[i, :count[i]].tolist() for i in range(b)]
    records = Records.from_arrays(rec)
    stats = SpecStats.compute(records, gamma=gamma, n_predict=int(count.sum()), eval_s=eval_s)
    return TorchSpecResult(tokens, stats, records, prompt_s, eval_s, n_loop)

  def _loop(self, tcache: Cache, dcache, prompts, first, n_predict, gamma,
            simulated, probs, gen):
    """speculative.spec_loop's steps in a host loop; returns (out [B, n_predict +
    gamma + 1], count [B], records {field: [steps, B]}, steps)."""
    torch = self.torch
    b = len(prompts)
    ar = torch.arange(b)
    pos = torch.arange(gamma + 1)[None, :]
    tail = torch.stack([torch.tensor([p[-1] for p in prompts]), first], 1)  # [B, 2]
    n = tcache.lengths + 1  # [B] sequence length so far
    out = torch.full((b, n_predict + gamma + 1), -1, dtype=torch.int64)
    out[:, 0] = first
    count = torch.ones((b,), dtype=torch.int64)
    done = count >= n_predict
    recs: dict[str, list] = {k: [] for k in ("n_acc", "n_drafted", "kept", "caught_up", "live")}
    i = 0
    while i < n_predict and not bool(done.all()):
      live = ~done
      live_np = live.numpy()
      # draft: a catch-up where a draft is behind, then gamma tokens [B, gamma]
      drafts, behind = self.draft.draft(tail, n, dcache, tcache, gamma, live)
      # verify: the target's argmax at [last, d_1..d_gamma]
      targ = self.target.step(torch.cat([tail[:, 1:], drafts], 1), tcache, live_np)
      # accept
      if simulated:
        ok = torch.rand((b, gamma), generator=gen) < probs[None, :]
      else:
        ok = drafts == targ[:, :gamma]
      n_acc = torch.cumprod(ok.long(), 1).sum(1)  # [B]
      nxt = targ[ar, n_acc]
      padded = torch.cat([drafts, drafts[:, :1]], 1)
      emitted = torch.where(pos == n_acc[:, None], nxt[:, None], padded)  # [B, gamma+1]
      prev_last = drafts[ar, (n_acc - 1).clamp(min=0)]
      prev = torch.where(n_acc > 0, prev_last, tail[:, 1])
      new_n = torch.where(live, n + n_acc + 1, n)
      t_len = new_n - 1
      d_len = torch.where(live, torch.minimum(new_n - 1, n - 1 + gamma), n - 1)
      new_tail = torch.where(live[:, None], torch.stack([prev, nxt], 1), tail)
      # keep at most n_predict tokens per row
      kept = torch.where(live, torch.minimum(n_acc + 1, n_predict - count), 0)
      for r in np.nonzero(live_np)[0]:
        out[r, count[r]:count[r] + gamma + 1] = emitted[r]
      count = count + kept
      done = done | (count >= n_predict)
      # commit: cut what n_predict dropped from the sequence, both caches, the tail
      dropped = torch.where(live, n_acc + 1 - kept, 0)
      n = new_n - dropped
      ext = torch.cat([tail[:, 1:], emitted], 1)  # [last, e_1 .. e_{gamma+1}]
      cut = torch.stack([ext[ar, (kept - 1).clamp(min=0)], ext[ar, kept]], 1)
      tail = torch.where((dropped > 0)[:, None], cut, new_tail)
      tcache.lengths.copy_(t_len - dropped)
      self.draft.commit(dcache, torch.minimum(d_len, n - 1))
      for k, v in (("n_acc", n_acc), ("n_drafted", torch.full((b,), gamma)), ("kept", kept),
                   ("caught_up", behind.long()), ("live", live.long())):
        recs[k].append(v.numpy().astype(np.int32))
      i += 1
    rec = {k: np.stack(v) if v else np.zeros((0, b), np.int32) for k, v in recs.items()}
    return out, count, rec, i

# ---------------------------------------------------------------- timing


def _median(xs):
  return statistics.median(xs)


def time_point(engine: TorchSpec, prompts, n_predict: int, gamma: int, rule: str,
               reps: int = 3, seed: int = 0, capacity: int | None = None) -> dict[str, Any]:
  """Target-only and speculative tokens/s at batch B = len(prompts), summed
  over rows (first token excluded, as specjax's), each repetition running
  both, the order alternating; medians over repetitions, speedup the median
  of each repetition's ratio (gamma.run_group's pairing). The first call of
  each (warm-up: torch.compile) is timed apart (`warmup_s`); a graph built
  during the timed repetitions raises (shapes changed)."""
  cap = capacity or generation.plan_capacity(
      engine.target.cfg, max(len(p) for p in prompts), n_predict, extra=gamma)
  base = lambda: engine.generate_target(prompts, n_predict, capacity=cap)
  spec = lambda: engine.generate(prompts, n_predict, gamma, rule=rule, seed=seed, capacity=cap)
  graphs0 = dynamo_graphs()
  t0 = time.perf_counter()
  base(), spec()
  warmup_s = time.perf_counter() - t0
  graphs = dynamo_graphs()
  rows, res, _ = paired_reps(base, spec, reps, len(prompts))
  if dynamo_graphs() != graphs:
    raise RuntimeError(f"{dynamo_graphs() - graphs} torch.compile graph(s) built inside "
                       f"the timed repetitions: shapes changed between runs")
  return {"engine": "torch" + ("-compile" if engine.target.compiled else "-eager"),
          "batch": len(prompts), "gamma": gamma, "accept_rule": str(rule),
          "n_predict": n_predict, "capacity": cap, "reps": reps, "seed": seed,
          **point_fields(rows, res.stats), "n_loop": res.n_loop, "warmup_s": warmup_s,
          "graphs_built": graphs - graphs0, "compile_note": engine.target.compile_note}


def paired_reps(base, spec, reps: int, n_rows: int):
  """`reps` repetitions of target-only and speculative generation, the order
  alternating (gamma.run_group's pairing). Returns (rows of per-token
  seconds {base_s, spec_s}, the last speculative result, the last
  target-only result); any engine whose results carry eval_s, n_eval and
  the SpecStats n_kept."""
  rows, res, b = [], None, None
  for rep in range(reps):
    if rep % 2:
      res, b = spec(), base()
    else:
      b, res = base(), spec()
    rows.append({"base_s": b.eval_s / (n_rows * b.n_eval),
                 "spec_s": res.eval_s / res.stats.n_kept})
  return rows, res, b


def point_fields(rows, st) -> dict[str, Any]:
  """A point's speeds (medians over the paired repetitions; speedup the
  median of each repetition's ratio) and acceptance counts."""
  speedups = [r["base_s"] / r["spec_s"] for r in rows]
  return {"baseline_tps": 1 / _median([r["base_s"] for r in rows]),
          "spec_tps": 1 / _median([r["spec_s"] for r in rows]),
          "speedup": _median(speedups), "speedup_reps": speedups,
          "n_steps": st.n_steps, "n_kept": st.n_kept, "n_accept": st.n_accept,
          "n_drafted": st.n_drafted, "n_catchup": st.n_catchup, "accept_rate": st.accept_rate,
          "mean_accepted": st.mean_accepted, "tokens_per_step": st.tokens_per_step}


class TorchCostProbe:
  """T(B, n): one forward over n new tokens per row (with the argmax of its
  logits, as the runs consume them) against a cache of `capacity` slots
  holding `depth` tokens per row; `k` forwards per repetition from the same
  state (lengths set back), time per forward (probes.CostProbe's shape, with
  the batch as a dimension; here each forward is a host call, as in the
  torch loop)."""

  def __init__(self, m: TorchLlama, batch: int, capacity: int, depth: int, seed: int = 0,
               k: int = REPEATS, random_kv: bool = False):
    self.m, self.batch, self.capacity, self.depth, self.k = m, batch, capacity, depth, k
    self.rng = np.random.RandomState(seed)
    if random_kv:  # a long context without its prefill (TorchLlama.random_cache)
      self.cache = m.random_cache(batch, capacity, depth, seed)
    else:
      self.cache = m.new_cache(batch, capacity)
      if depth:
        m.prefill(self.rng.randint(0, m.cfg.vocab_size, (batch, depth)).tolist(), self.cache)
    self.warm: set[int] = set()

  def times(self, ns: Sequence[int], reps: int = 3) -> dict[int, timing.Timing]:
    torch = self.m.torch
    kvc.check_capacity([self.depth], max(ns), self.capacity)
    out = {}
    for n in sorted(set(ns)):
      tokens = torch.from_numpy(self.rng.randint(0, self.m.cfg.vocab_size, (self.batch, n)))

      def run(tokens=tokens):
        for _ in range(self.k):
          self.cache.lengths.fill_(self.depth)
          self.m.step(tokens, self.cache)

      warm_s = 0.0
      if n not in self.warm:
        t0 = time.perf_counter()
        run()
        warm_s = time.perf_counter() - t0
        self.warm.add(n)
      times = []
      for _ in range(reps):
        t0 = time.perf_counter()
        run()
        times.append((time.perf_counter() - t0) / self.k)
      out[n] = timing.Timing(times=times, compile_s=warm_s)
    return out


def make_engine(tcfg: ModelConfig, tparams, dcfg: ModelConfig | None = None, dparams=None,
                compile: bool = True, threads: int | None = None) -> TorchSpec:
  """A TorchSpec on the same weights as specjax's params (hf.to_torch_model)."""
  target = TorchLlama(tcfg, tparams, compile=compile, threads=threads)
  draft = (None if dcfg is None
           else TorchLlama(dcfg, dparams, compile=compile, threads=threads))
  return TorchSpec(target, draft)

