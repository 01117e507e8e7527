"""Throughput benchmarks: llama-bench and llama-batched-bench, timed with
metrics.timing.measure (warm-up untimed, compile apart, clocks stopped after
`block_until_ready`).
  run_bench          llama-bench: from a cache holding `n_depth` tokens
                     (batch 1), pp N (one forward over N new tokens: the
                     verify's shape) and tg N (N decode steps as one run); t/s
                     mean +- std over repetitions; pp records carry
                     verify_ratio = T(N) / T(1), the verify-cost curve
  run_batched_bench  llama-batched-bench: B rows of PP prompt tokens then TG
                     decode steps (N_KV = B (PP + TG), S_PP = B PP / T_PP,
                     S_TG = B TG / T_TG, S = N_KV / (T_PP + T_TG))
  attention_scaling  decode against the capacity and the used length, blocked
                     next to masked attention
The capacity is fixed per model and recorded with every result (attention
reads whole blocks up to the used length: `attended_slots`). docs/decode_cost.md.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.formats import checkpoint
from specjax.decode import probes
from specjax.model import config as config_lib
from specjax.model import kv_cache as kvc
from specjax.model import steps
from specjax.metrics import timing
from specjax import workdir as wd
from specjax.errors import ConfigError
from specjax.workdir import Record
from specjax.bench import tables
from specjax.bench.studies import roofline


# ----------------------------------------------------------------------------
# Shared helpers: flag lists, units, tables.


@dataclasses.dataclass(frozen=True)
class BenchTest:
  """One llama-bench test: `pp` (one call over n tokens) or `tg` (n steps)."""
  kind: str
  n: int
  depth: int = 0

  @property
  def name(self) -> str:
    """llama-bench's test label: 'pp16', 'tg32 @ d128'."""
    return f"{self.kind}{self.n}" + (f" @ d{self.depth}" if self.depth else "")

  @property
  def n_calls(self) -> int:
    """forward_step calls per repetition."""
    return 1 if self.kind == "pp" else self.n


def pp_runner(m: steps.Runner, holder: list, tokens: jax.Array, depth: np.ndarray):
  """pp: roll back to depth, one forward_step over tokens [B, N]."""
  def run():
    cache = kvc.rollback(holder[0], depth)
    logits, holder[0] = m.forward(tokens, cache, lengths=depth)
    return logits
  return run


def _tg_run(m: steps.Runner, holder: list, tok: jax.Array, depth: np.ndarray,
            n: int):
  """tg: roll back to depth, n decode steps of tok [B, 1] queued back to back.

  The cache is threaded through `holder` because forward_step donates it.
  """
  def run():
    cache = kvc.rollback(holder[0], depth)
    for i in range(n):
      logits, cache = m.forward(tok, cache, lengths=depth + i)
    holder[0] = cache
    return logits
  return run


def bench_model(m: steps.Runner, n_prompt: Sequence[int], n_gen: int,
                n_depth: int, reps: int, seed: int = 0,
                extra: Record | None = None,
                on_record: Callable[[Record], None] | None = None
                ) -> list[Record]:
  """Runs pp N for each N in n_prompt (ascending), then tg n_gen (batch 1).

  Args:
    m: the model; its cfg.dtype is the dtype reported.
    n_prompt: the pp sizes; n_gen: tg length (0 skips tg).
    n_depth: tokens already in the cache before every repetition.
    reps: timed repetitions per test (after one untimed warm-up).
    extra: fields added to every record (environment, model spec).
    on_record: called with each finished record, as soon as its test is done.
  Returns:
    One record per test (`bench_record`).
  """
  tests = [BenchTest("pp", n, n_depth) for n in sorted(set(n_prompt))]
  tests += [BenchTest("tg", n_gen, n_depth)] if n_gen else []
  capacity = kvc.round_capacity(n_depth + max(t.n for t in tests))
  kvc.check_capacity([n_depth], max(t.n for t in tests), capacity)
  rng = np.random.RandomState(seed)
  holder = [probes.filled_cache(m, 1, capacity, n_depth, rng)]
  depth = np.full((1,), n_depth, np.int32)
  info = {**tables.model_info(m.cfg, m.params), **(extra or {})}
  records, t1 = [], None
  for test in tests:
    if test.kind == "pp":
      run = pp_runner(m, holder, probes.random_tokens(rng, m.cfg.vocab_size, 1, test.n), depth)
    else:
      run = _tg_run(m, holder, probes.random_tokens(rng, m.cfg.vocab_size, 1, 1), depth, test.n)
    t = timing.measure(run, reps=reps)
    if test.kind == "pp" and test.n == 1:
      t1 = t.median  # pp1 runs first: the base of every verify_ratio
    records.append(bench_record(info, test, t, capacity, t1))
    if on_record:
      on_record(records[-1])
  return records


def bench_record(info: Record, test: BenchTest, t: timing.Timing,
                 capacity: int, t1_s: float | None = None) -> Record:
  """One llama-bench result: model info, test, timings, t/s, and for pp
  tests verify_ratio = T(N) / T(1) (medians; None without a T(1))."""
  tps = [test.n / s for s in t.times]  # per-repetition tokens/s
  ratio = t.median / t1_s if (test.kind == "pp" and t1_s) else None
  return {**info, "test": test.name, "kind": test.kind, "n_tokens": test.n,
          "n_depth": test.depth, "batch": 1, "capacity": capacity,
          "times_s": t.times, **t.to_dict(),
          "tps_mean": float(np.mean(tps)),
          "tps_std": float(np.std(tps, ddof=1)) if len(tps) > 1 else 0.0,
          "ms_per_call": 1e3 * t.median / test.n_calls,
          "verify_ratio": ratio, "load_avg": wd.load_avg()}


def run_bench(models: Sequence[str], dtypes: Sequence[str],
              n_prompt: Sequence[int], n_gen: int, n_depth: int, reps: int,
              seed: int = 0, on_record: Callable[[Record], None] | None = None,
              load: Callable = checkpoint.load_model) -> list[Record]:
  """llama-bench over models x dtypes; every record carries the environment.

  Args:
    models: `--model` values (presets, HF or orbax directories).
    dtypes: compute and param dtypes ('float32', 'bf16', ...).
    load: (spec, dtype=, seed=) -> (cfg, params, tokenizer), the model loader.
  """
  if reps < 1:
    raise ConfigError(f"reps must be >= 1, got {reps}")
  if n_depth < 0 or n_gen < 0 or not n_prompt or min(n_prompt) < 1:
    raise ConfigError("need n_depth >= 0, n_gen >= 0 and n_prompt sizes >= 1")
  env = wd.environment()
  records = []
  for spec in models:
    for dtype in dtypes:
      cfg, params, _ = load(spec, dtype=config_lib.canonical_precision(dtype),
                            seed=seed)
      need = n_depth + max(max(n_prompt), n_gen)
      if need > cfg.max_seq_len:
        raise ConfigError(f"{cfg.name}: n_depth + largest test = {need} "
                          f"exceeds max_seq_len {cfg.max_seq_len}")
      records += bench_model(steps.Runner(cfg, params), n_prompt, n_gen,
                             n_depth, reps, seed,
                             extra={"model_spec": spec, "env": env},
                             on_record=on_record)
      del params
  return records


BENCH_COLUMNS = ("model", "size", "params", "backend", "dtype", "test",
                 "t/s", "ms/call (median)", "compile s")
_BENCH_RIGHT = (False, True, True, False, False, True, True, True, True)


def bench_row(r: Record) -> list[str]:
  """One table row: t/s mean ± std; ms per forward_step call, median."""
  return [r["model"], tables.format_size(r["size_bytes"]), tables.format_params(r["n_params"]),
          r["backend"], r["dtype"], r["test"],
          f"{r['tps_mean']:.2f} ± {r['tps_std']:.2f}",
          f"{r['ms_per_call']:.2f}", f"{r['compile_s']:.2f}"]


def bench_table(records: Sequence[Record]) -> str:
  """The llama-bench markdown table (+ ms per call and compile seconds)."""
  return tables.markdown_table(BENCH_COLUMNS, [bench_row(r) for r in records],
                        _BENCH_RIGHT)


BENCH_NOTES = (
    "t/s: tokens / repetition time, mean ± std over repetitions. "
    "ms/call: median ms of one forward_step call (pp N: the one call over N "
    "tokens; tg N: repetition time / N). compile s: compilation this test "
    "triggered (0 when an earlier test compiled the same shape), excluded "
    "from every timing.")


def verify_curve_table(records: Sequence[Record]) -> str:
  """T(N) / T(1) per model and dtype: the cost of verifying N tokens."""
  pp = [r for r in records if r["kind"] == "pp" and r["verify_ratio"]]
  return tables.markdown_table(
      ("model", "dtype", "N", "T(N) ms", "T(N)/T(1)"),
      [(r["model"], r["dtype"], str(r["n_tokens"]),
        f"{1e3 * r['median_s']:.2f}", f"{r['verify_ratio']:.3f}") for r in pp],
      (False, False, True, True, True))


# ----------------------------------------------------------------------------
# Decode cost against the cache capacity and the used length.


def attention_scaling(m: steps.Runner, points: Sequence[tuple[int, int]], n_gen: int,
                      reps: int, seed: int = 0, masked: bool = True,
                      on_record: Callable[[Record], None] | None = None) -> list[Record]:
  """Decode ms/token (batch 1) at each (capacity, depth) point: n_gen decode
  steps from a cache of `capacity` slots holding `depth` tokens.

  Blocked attention (cfg.attn_block; forced, as a GPU loads the masked kind
  by default) and, with `masked`, the same weights with one masked pass
  over the capacity (attn_block 0), alternating at every point so both see
  the same machine state.
  """
  if reps < 1 or n_gen < 1:
    raise ConfigError(f"need reps >= 1 and n_gen >= 1, got {reps}, {n_gen}")
  for cap, depth in points:
    if depth < 1 or depth + n_gen > cap:
      raise ConfigError(f"point (capacity {cap}, depth {depth}): need 1 <= depth and "
                        f"depth + n_gen ({n_gen}) <= capacity")
  variants = [("blocked", steps.Runner(m.cfg.replace(attention="blocked"), m.params))]
  if masked and m.cfg.attn_block:
    variants.append(("masked", steps.Runner(m.cfg.replace(attn_block=0), m.params)))
  rng = np.random.RandomState(seed)
  tok = probes.random_tokens(rng, m.cfg.vocab_size, 1, 1)
  info, records = tables.model_info(m.cfg, m.params), []
  for cap, depth in points:
    dep = np.full((1,), depth, np.int32)
    for name, runner in variants:
      holder = [probes.filled_cache(runner, 1, cap, depth, np.random.RandomState(seed))]
      t = timing.measure(_tg_run(runner, holder, tok, dep, n_gen), reps=reps)
      block = runner.cfg.attn_block
      records.append({**info, "kind": "attention", "variant": name, "capacity": cap,
                      "n_depth": depth, "n_tokens": n_gen, "attn_block": block,
                      "attended_slots": roofline.attended_slots(runner.cfg, cap, depth + n_gen),
                      **t.to_dict(), "ms_per_token": 1e3 * t.median / n_gen,
                      "load_avg": wd.load_avg()})
      if on_record:
        on_record(records[-1])
  return records


def attention_table(records: Sequence[Record]) -> str:
  """ms/token per (capacity, depth), one column per variant."""
  variants = list(dict.fromkeys(r["variant"] for r in records))
  cell = {(r["capacity"], r["n_depth"], r["variant"]): r["ms_per_token"] for r in records}
  keys = list(dict.fromkeys((r["capacity"], r["n_depth"]) for r in records))
  rows = [[str(c), str(d)] + [f"{cell[(c, d, v)]:.2f}" if (c, d, v) in cell else "-"
                              for v in variants] for c, d in keys]
  return tables.markdown_table(["capacity", "depth"] + [f"{v} ms/token" for v in variants], rows,
                        [True] * (2 + len(variants)))


# ----------------------------------------------------------------------------
# llama-batched-bench.


def _prefill_run(m: steps.Runner, holder: list, tokens: jax.Array):
  """Prompt phase: roll back to 0, one prefill_step over tokens [B, PP]
  (logits of each row's last token only, as llama-batched-bench asks)."""
  b, pp = tokens.shape
  n_valid = jnp.full((b,), pp, jnp.int32)
  zero = np.zeros((b,), np.int32)
  def run():
    cache = kvc.rollback(holder[0], zero)
    logits, holder[0] = steps.prefill_step(m.params, tokens, n_valid, cache,
                                           cfg=m.cfg)
    return logits
  return run


def batched_point(m: steps.Runner, b: int, pp: int, tg: int, capacity: int,
                  reps: int, rng: np.random.RandomState) -> Record:
  """One (PP, TG, B) point: T_PP and T_TG medians from `timing.measure`."""
  kvc.check_capacity([0], pp + tg, capacity)
  holder = [m.new_cache(b, capacity)]
  t_pp = timing.measure(_prefill_run(m, holder, probes.random_tokens(rng, m.cfg.vocab_size, b, pp)),
                        reps=reps)
  # The cache now holds the PP prompt tokens of every row.
  depth = np.full((b,), pp, np.int32)
  t_tg = timing.measure(_tg_run(m, holder, probes.random_tokens(rng, m.cfg.vocab_size, b, 1),
                                depth, tg), reps=reps)
  return batched_record(pp, tg, b, t_pp, t_tg, capacity)


def batched_record(pp: int, tg: int, b: int, t_pp: timing.Timing,
                   t_tg: timing.Timing, capacity: int) -> Record:
  """llama-batched-bench's numbers, each defined once here."""
  n_kv = b * (pp + tg)
  tp, tt = t_pp.median, t_tg.median
  return {"pp": pp, "tg": tg, "batch": b, "n_kv": n_kv,
          "t_pp_s": tp, "s_pp_tps": b * pp / tp,
          "t_tg_s": tt, "s_tg_tps": b * tg / tt,
          "t_s": tp + tt, "s_tps": n_kv / (tp + tt),
          "capacity": capacity, "timing_pp": t_pp.to_dict(),
          "timing_tg": t_tg.to_dict(), "load_avg": wd.load_avg()}


def run_batched_bench(m: steps.Runner, batches: Sequence[int],
                      pps: Sequence[int], tgs: Sequence[int], reps: int,
                      seed: int = 0,
                      on_record: Callable[[Record], None] | None = None
                      ) -> list[Record]:
  """llama-batched-bench: every (PP, TG, B), in llama.cpp's loop order.

  The capacity is max(PP) + max(TG) (rounded up) for every point, so each
  (B, PP) prompt shape and each B decode shape compiles once.
  """
  if reps < 1:
    raise ConfigError(f"reps must be >= 1, got {reps}")
  capacity = kvc.round_capacity(max(pps) + max(tgs))
  if max(pps) + max(tgs) > m.cfg.max_seq_len:
    raise ConfigError(f"{m.cfg.name}: PP + TG = {max(pps) + max(tgs)} exceeds "
                      f"max_seq_len {m.cfg.max_seq_len}")
  info, env = tables.model_info(m.cfg, m.params), wd.environment()
  rng = np.random.RandomState(seed)
  records = []
  for pp in pps:
    for tg in tgs:
      for b in batches:
        r = {**info, **batched_point(m, b, pp, tg, capacity, reps, rng),
             "env": env}
        records.append(r)
        if on_record:
          on_record(r)
  return records


BATCHED_COLUMNS = ("PP", "TG", "B", "N_KV", "T_PP s", "S_PP t/s", "T_TG s",
                   "S_TG t/s", "T s", "S t/s")


def batched_row(r: Record) -> list[str]:
  return [str(r["pp"]), str(r["tg"]), str(r["batch"]), str(r["n_kv"]),
          f"{r['t_pp_s']:.3f}", f"{r['s_pp_tps']:.2f}", f"{r['t_tg_s']:.3f}",
          f"{r['s_tg_tps']:.2f}", f"{r['t_s']:.3f}", f"{r['s_tps']:.2f}"]


def batched_table(records: Sequence[Record]) -> str:
  return tables.markdown_table(BATCHED_COLUMNS, [batched_row(r) for r in records],
                        [True] * len(BATCHED_COLUMNS))


# ----------------------------------------------------------------------------
# Memory-bandwidth roofline: decode reads every weight and the whole cache.
