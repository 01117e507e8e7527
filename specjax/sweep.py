"""The gamma x acceptance sweep: measured speedup next to the theory's.

For every (gamma, acceptance) point, in one run on one machine:
  measured   target-only tokens/s and speculative tokens/s (device loop,
             medians over repetitions of identical work), their ratio, and
             the acceptance statistics (specjax.stats);
  costs      T_target(1), T_target(gamma+1) and T_draft(1), each one forward
             against a cache of the run's capacity (bench.CostProbe),
             measured in every repetition between the runs; and the
             accept/commit cost per step;
  predicted  Leviathan's Theorem 3.8 at the measured alpha and c, the
             thread's approximation, and the measured-cost model:
               tokens_per_step * T_t(1) /
               (gamma T_d(1) + f_full T_d(1) + T_t(gamma+1) + T_accept)
             where f_full is the share of steps that accepted every draft
             (the draft must then be fed d_gamma: one more draft step);
  efficiency measured / measured-cost prediction;
  split      draft / verify / accept / rest shares of the step time, from
             one run of the host loop (which times each phase).

Outputs (workdir): results.jsonl (appended as each point finishes; `resume`
skips finished points), results.csv, config.json, costs.json,
speedup.png, verify_cost.png and summary.md.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax import acceptance, bench, checkpoint, cli, generation, speculative, steps
from specjax import theory, timing
from specjax.errors import ConfigError
from specjax.sampling import SamplingParams
from specjax import stats as stats_lib

CSV_COLUMNS = [
    "gamma", "accept", "temp", "baseline_tps", "spec_tps", "speedup", "accept_rate",
    "mean_accepted", "tokens_per_step", "alpha", "c", "verify_ratio",
    "predicted_leviathan", "predicted_thread", "predicted_measured_cost", "efficiency",
    "draft_share", "verify_share", "accept_share", "rest_share", "n_steps", "compile_s"]


@dataclasses.dataclass
class Costs:
  """Measured per-call costs (seconds, medians) at the sweep's cache capacity."""
  t_target: dict[int, float]        # T_target(n)
  t_draft: float                    # T_draft(1)
  t_accept: dict[int, float]        # accept + commit per step, by gamma
  capacity: int
  depth: int

  @property
  def c(self) -> float:
    return self.t_draft / self.t_target[1]

  def verify_ratio(self, n: int) -> float:
    return self.t_target[n] / self.t_target[1]

  def to_dict(self) -> dict[str, Any]:
    return {"t_target_s": {str(k): v for k, v in self.t_target.items()},
            "t_draft_s": self.t_draft, "c": self.c,
            "t_accept_s": {str(k): v for k, v in self.t_accept.items()},
            "verify_ratio": {str(k): self.verify_ratio(k) for k in self.t_target},
            "capacity": self.capacity, "depth": self.depth}


def validate(cfg) -> None:
  """Bad sweep settings -> one ConfigError naming the field."""
  if not cfg.gammas or any(int(g) < 1 or int(g) > 64 for g in cfg.gammas):
    raise ConfigError(f"config.gammas must be integers in [1, 64], got {list(cfg.gammas)}")
  if not cfg.accepts:
    raise ConfigError("config.accepts is empty")
  for a in cfg.accepts:
    for g in cfg.gammas:
      acceptance.parse_rule(a).resolve(int(g))
  if int(cfg.get("heldout_prompts", 0)) < 0:
    raise ConfigError(f"config.heldout_prompts must be >= 0, got {cfg.heldout_prompts}")
  for name in ("n_predict", "reps"):
    if int(getattr(cfg, name)) < 1:
      raise ConfigError(f"config.{name} must be >= 1, got {getattr(cfg, name)}")
  if not list(cfg.temps):
    raise ConfigError("config.temps is empty")
  for t in cfg.temps:
    SamplingParams(float(t), int(cfg.top_k), float(cfg.top_p))


def measure_costs(probe_t: bench.CostProbe, probe_d: bench.CostProbe, gammas, reps: int,
                  sp: SamplingParams) -> Costs:
  """The whole cost curve T_target(1..max gamma + 1), T_draft(1), accept costs."""
  ns = sorted({1} | {g + 1 for g in gammas} | set(gammas))
  t_target = {n: t.median for n, t in probe_t.times(ns, reps).items()}
  t_draft = probe_d.times([1], reps)[1].median
  t_accept = {g: accept_cost(probe_t.m.cfg, probe_d.m.cfg, g, sp, reps) for g in gammas}
  return Costs(t_target, t_draft, t_accept, probe_t.capacity, probe_t.depth)


def accept_cost(tcfg, dcfg, gamma: int, sp: SamplingParams, reps: int) -> float:
  """Median time of one accept/commit phase (the real rule, batch 1)."""
  sc = speculative.SpecConfig(tcfg, dcfg, gamma, sp)
  v = tcfg.vocab_size
  k = jax.random.split(jax.random.PRNGKey(0), 4)
  p = jax.nn.softmax(jax.random.normal(k[0], (1, gamma + 1, v)), -1)
  q = jax.nn.softmax(jax.random.normal(k[1], (1, gamma, v)), -1)
  q = q if sc.needs_q else q[..., :0]
  drafts = jax.random.randint(k[2], (1, gamma), 0, v)
  tail, n = jnp.zeros((1, 2), jnp.int32), jnp.full((1,), 8, jnp.int32)
  m, live = jnp.full((1,), gamma, jnp.int32), jnp.ones((1,), bool)
  run = lambda: speculative.accept_jit(k[3], jnp.ones((gamma,)), p, q, drafts, m, tail, n,
                                       live, sc=sc)
  return timing.measure(run, reps=max(reps, 5)).median


def run_point(target, draft, prompts, gamma: int, accept: str, sp: SamplingParams,
              cfg, costs: Costs, probes) -> dict[str, Any]:
  """Measures one (gamma, accept, temperature) point and its predictions.

  Each repetition runs target-only, then speculative (each over every
  prompt, one after another, batch 1), then the cost probes (T_target(1),
  T_target(gamma), T_target(gamma+1), T_draft(1)), so the measured speedup
  and the costs that predict it see the same machine state; every figure is
  the median over repetitions. Tokens/s pool all prompts; so do the
  acceptance statistics.
  """
  n, seed, ctx = int(cfg.n_predict), int(cfg.seed), int(cfg.ctx_size)

  def spec(loop):
    return [speculative.generate(target, draft, [p], n, gamma, sp=sp, rule=accept, seed=seed,
                                 ctx_size=ctx, capacity=costs.capacity, loop=loop)
            for p in prompts]

  def base():
    return [generation.generate(target, [p], n, sp, seed=seed, ctx_size=ctx,
                                capacity=costs.capacity) for p in prompts]

  compile_s = sum(r.compile_s for r in spec("device") + base())  # warm-up
  spec_s, base_s, t_t, t_d = [], [], [], []
  for _ in range(int(cfg.reps)):
    b = base()
    res = spec("device")
    base_s.append(sum(r.eval_s for r in b) / sum(r.n_eval for r in b))
    spec_s.append(sum(r.eval_s for r in res) / sum(r.stats.n_predict - 1 for r in res))
    t_t.append({k: v.median for k, v in probes[0].times([1, gamma, gamma + 1]).items()})
    t_d.append(probes[1].times([1])[1].median)
  med = statistics.median
  here = Costs({k: med(t[k] for t in t_t) for k in t_t[0]}, med(t_d), costs.t_accept,
               costs.capacity, costs.depth)
  pooled = stats_lib.Records.concat([r.records for r in res])
  st = stats_lib.SpecStats.compute(pooled, gamma=gamma,
                                   n_predict=sum(r.stats.n_predict for r in res))
  split = {}
  if cfg.measure_split:
    spec("host")  # compiles the phase functions
    phase: dict[str, float] = {}
    for r in spec("host"):
      for k, v in r.stats.phase_s.items():
        phase[k] = phase.get(k, 0.0) + v
    total = sum(phase.values())
    split = {f"{k[:-2]}_share": v / total for k, v in phase.items()}
  rec = point_record(gamma, accept, sp, st, 1 / med(spec_s), 1 / med(base_s), here,
                     split, compile_s)
  rec.update(t_target_1_s=here.t_target[1], t_verify_s=here.t_target[gamma + 1],
             t_draft_1_s=here.t_draft, n_prompts=len(prompts),
             geometric=stats_lib.geometric_check(st))
  return rec


def point_record(gamma, accept, sp, st, spec_tps, baseline_tps, costs: Costs, split,
                 compile_s) -> dict[str, Any]:
  """All the numbers of one point; every prediction comes from theory.py."""
  t1, td = costs.t_target[1], costs.t_draft
  full = st.accept_hist[-1] / max(st.n_steps, 1)
  overhead = full * td + costs.t_accept[gamma]
  pred_cost = theory.measured_cost_speedup(st.tokens_per_step, gamma, td, t1,
                                           costs.t_target[gamma + 1], overhead)
  speedup = spec_tps / baseline_tps
  return {
      "gamma": gamma, "accept": accept, "temp": sp.temperature,
      "baseline_tps": baseline_tps, "spec_tps": spec_tps, "speedup": speedup,
      "accept_rate": st.accept, "mean_accepted": st.mean_accepted,
      "tokens_per_step": st.tokens_per_step, "alpha": st.alpha, "c": costs.c,
      "verify_ratio": costs.verify_ratio(gamma + 1),
      "predicted_leviathan": theory.leviathan_speedup(st.alpha, gamma, costs.c),
      "predicted_thread": theory.thread_approx_speedup(
          st.alpha, gamma, 1 / td, 1 / t1, gamma / costs.t_target[gamma]),
      "predicted_measured_cost": pred_cost, "efficiency": speedup / pred_cost,
      "full_accept_share": full, "t_accept_s": costs.t_accept[gamma],
      "n_steps": st.n_steps, "compile_s": compile_s, **split,
      "stats": st.to_dict(),
  }


def point_key(rec: dict[str, Any]) -> tuple:
  return (int(rec["gamma"]), str(rec["accept"]), float(rec["temp"]))


def load_finished(path: str) -> list[dict[str, Any]]:
  """Records already in results.jsonl (a torn last line is ignored)."""
  if not os.path.exists(path):
    return []
  out = []
  with open(path) as f:
    for line in f:
      try:
        out.append(json.loads(line))
      except json.JSONDecodeError:
        pass
  return out


def write_csv(path: str, records: list[dict[str, Any]]) -> None:
  with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
    w.writeheader()
    for r in records:
      w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})


def run_sweep(cfg, workdir: str, resume: bool = False, progress: bool = True) -> list[dict]:
  """Runs every point of the config; returns all records (finished + new)."""
  validate(cfg)
  os.makedirs(workdir, exist_ok=True)
  jsonl = os.path.join(workdir, "results.jsonl")
  done = load_finished(jsonl) if resume else []
  if done:
    _check_same_sweep(os.path.join(workdir, "config.json"), cfg)
  # Rewrite only whole records, so a line torn by an interruption is dropped
  # instead of having the next record glued onto it.
  with open(jsonl, "w") as f:
    f.writelines(json.dumps(r, default=cli.json_default) + "\n" for r in done)
  env = timing.environment()
  cli.write_json(os.path.join(workdir, "config.json"), {"config": cfg.to_dict(), "env": env})

  tcfg, tparams, tok = checkpoint.load_model(cfg.target, dtype=cfg.dtype, seed=int(cfg.seed))
  dcfg, dparams, _ = checkpoint.load_model(cfg.draft, dtype=cfg.dtype, seed=int(cfg.seed) + 1)
  target, draft = steps.Model(tcfg, tparams), steps.Model(dcfg, dparams)
  speculative.SpecConfig(tcfg, dcfg, 1)  # vocabulary check, before any timing
  prompts = sweep_prompts(cfg, tok, tcfg.vocab_size)
  depth = max(len(p) for p in prompts)
  gammas = sorted(int(g) for g in cfg.gammas)
  capacity = generation.plan_capacity(tcfg, depth, int(cfg.n_predict),
                                      extra=max(gammas) + 1, ctx_size=int(cfg.ctx_size))
  points = [(g, a, float(t)) for t in cfg.temps for g in gammas for a in cfg.accepts]
  finished = {point_key(r) for r in done}
  todo = [p for p in points if (p[0], p[1], p[2]) not in finished]

  records = list(done)
  bar = _progress(len(points), len(points) - len(todo), progress)
  n_new, t_start = 0, time.perf_counter()
  sp0 = SamplingParams(float(cfg.temps[0]), int(cfg.top_k), float(cfg.top_p))
  probes = (bench.CostProbe(target, capacity, depth),
            bench.CostProbe(draft, capacity, depth))
  costs = measure_costs(*probes, gammas, int(cfg.reps), sp0)
  cli.write_json(os.path.join(workdir, "costs.json"), costs.to_dict())
  for g, a, temp in todo:
    sp = SamplingParams(temp, int(cfg.top_k), float(cfg.top_p))
    rec = run_point(target, draft, prompts, g, a, sp, cfg, costs, probes)
    rec.update(target=tcfg.name, draft=dcfg.name, dtype=tcfg.precision, env=env)
    bench.append_jsonl(jsonl, [rec])
    records.append(rec)
    write_csv(os.path.join(workdir, "results.csv"), records)
    bar.update(1)
    bar.set_postfix_str(f"g={g} {a} T={temp:g}: {rec['speedup']:.2f}x")
    n_new += 1
    if not progress:  # logs: one line per point with the time left
      left = (time.perf_counter() - t_start) / n_new * (len(todo) - n_new)
      print(f"point {len(records)}/{len(points)}: gamma {g}, {a}, T={temp:g}: speedup "
            f"{rec['speedup']:.3f}x, efficiency {rec['efficiency']:.3f}; ~{left / 60:.1f} min left",
            flush=True)
  bar.close()
  from specjax import sweep_report  # matplotlib only when writing the report
  sweep_report.write_report(workdir, records, costs.to_dict(), cfg)
  return records


def sweep_prompts(cfg, tok, vocab_size: int) -> list[list[int]]:
  """The prompts of a sweep: `heldout_prompts` shipped held-out prompts, or one."""
  n = int(cfg.get("heldout_prompts", 0))
  if n:
    if tok is None:
      raise ConfigError("config.heldout_prompts needs a target with a tokenizer")
    from specjax import pair  # pylint: disable=import-outside-toplevel
    texts = pair.shipped_prompts(n)
    if len(texts) < n:
      raise ConfigError(f"config.heldout_prompts={n}, but only {len(texts)} are shipped")
    return [tok.encode(t) for t in texts]
  return [cli.parse_prompt(cfg.prompt or None, cfg.prompt_tokens or None, tok, vocab_size)]


# Fields that may change between a run and its --resume (they only add points).
_POINT_FIELDS = ("gammas", "accepts", "temps")


def _check_same_sweep(path: str, cfg) -> None:
  """Resuming into a workdir whose points were measured differently is refused."""
  try:
    with open(path) as f:
      old = json.load(f)["config"]
  except (OSError, ValueError, KeyError):
    return
  new = json.loads(json.dumps(cfg.to_dict(), default=cli.json_default))
  diff = sorted(k for k in set(old) | set(new)
                if k not in _POINT_FIELDS and old.get(k) != new.get(k))
  if diff:
    raise ConfigError(f"cannot resume: the workdir's sweep used different settings for "
                      f"{', '.join(diff)}; use another --workdir or the same config")


def _progress(total: int, initial: int, enabled: bool):
  from tqdm import tqdm
  return tqdm(total=total, initial=initial, desc="sweep points", unit="pt",
              disable=not enabled, dynamic_ncols=True)
