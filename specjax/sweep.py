"""The gamma x acceptance sweep: measured speedup next to the theory's.

For every (gamma, acceptance rule, temperature) point, in one run on one
machine:
  measured   target-only tokens/s and speculative tokens/s (device loop,
             medians over repetitions of identical work, the two alternating),
             their ratio, and the acceptance statistics (specjax.stats);
  costs      T_target(1), T_target(gamma), T_target(gamma+1) and T_draft(1)
             with the point's sampling settings, measured in every repetition
             between the runs they predict, and the point's accept cost
             (specjax.costs);
  predicted  Leviathan's Theorem 3.8 at the measured alpha and c, the
             thread's approximation, and the measured-cost model
             (costs.predict);
  efficiency measured / measured-cost prediction, paired within each
             repetition (run_point), median over repetitions;
  split      draft / verify / accept / rest shares of the step time, from
             one run of the host loop (which times each phase).
Nothing may compile inside a timed repetition: it would be timed as work.

Outputs (workdir, specjax.workdir's conventions): results.jsonl (appended as
each point finishes; `resume` skips finished points), results.csv,
config.json, costs.json, speedup.png, verify_cost.png, acceptance.png and
summary.md. Records follow specjax.schema.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from typing import Any

from specjax import acceptance, checkpoint, cli, costs, drafters, generation, schema, speculative
from specjax import stats as stats_lib
from specjax import steps, workdir as wd
from specjax.errors import ConfigError, SpecjaxError
from specjax.sampling import SamplingParams
from specjax.timing import CompileWatch

Record = dict[str, Any]


def validate(cfg) -> None:
  """Bad sweep settings -> one ConfigError naming the field."""
  if not cfg.gammas or any(int(g) < 1 or int(g) > 64 for g in cfg.gammas):
    raise ConfigError(f"config.gammas must be integers in [1, 64], got {list(cfg.gammas)}")
  if not cfg.accepts:
    raise ConfigError("config.accepts is empty")
  drafters.parse(cfg.get("drafter", "model"))
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


@dataclasses.dataclass(frozen=True)
class Point:
  gamma: int
  accept_rule: str
  sp: SamplingParams

  @property
  def key(self) -> tuple:
    return (self.gamma, self.accept_rule, self.sp.temperature)


def point_key(rec: Record) -> tuple:
  return (int(rec["gamma"]), str(rec["accept_rule"]), float(rec["temperature"]))


@dataclasses.dataclass
class Bench:
  """What every point of a sweep shares: models, prompts, capacity, probes."""
  target: steps.Runner
  draft: steps.Runner | None  # the draft model (drafter `model`), else None
  prompts: list[list[int]]
  capacity: int
  probe_t: costs.CostProbe
  probe_d: costs.CostProbe | costs.ProposeProbe
  cfg: Any
  compiled: set = dataclasses.field(default_factory=set)  # programs already run once
  drafter: drafters.Drafter = drafters.MODEL

  def warm_up(self, p: Point, split: bool) -> float:
    """Runs once, untimed, what this point needs and no earlier point has
    compiled: the speculative loop (one program per gamma, rule kind and
    sampling settings: a simulated rule's rate is traced), the target-only
    loop (per sampling settings) and the host loop's phases. Returns the
    compile seconds (0 when everything was warm)."""
    kind = acceptance.parse_rule(p.accept_rule).simulated
    runs = {("spec", p.gamma, kind, p.sp): lambda: self.spec(p),
            ("base", p.sp): lambda: self.base(p)}
    if split:
      runs[("host", p.gamma, kind, p.sp)] = lambda: self.spec(p, "host")
    compile_s = 0.0
    for key, run in runs.items():
      if key not in self.compiled:
        compile_s += sum(r.compile_s for r in run())
        self.compiled.add(key)
    return compile_s

  def spec(self, p: Point, loop: str = "device") -> list[speculative.SpecResult]:
    c = self.cfg
    return [speculative.generate(self.target, self.draft, [prompt], int(c.n_predict), p.gamma,
                                 sp=p.sp, rule=p.accept_rule, seed=int(c.seed),
                                 capacity=self.capacity, loop=loop, drafter=self.drafter)
            for prompt in self.prompts]

  def base(self, p: Point) -> list[generation.GenerationResult]:
    c = self.cfg
    return [generation.generate(self.target, [prompt], int(c.n_predict), p.sp, seed=int(c.seed),
                                capacity=self.capacity) for prompt in self.prompts]


PROBE_REPS = 3  # probe repetitions per sweep repetition (of costs.PROBE_REPEATS forwards)


def _rep_costs(bench: Bench, p: Point) -> dict[str, float]:
  """The point's costs, each the median of PROBE_REPS short probes: cheap
  next to the runs, and a single probe is as noisy as the machine."""
  ts = bench.probe_t.times([1, p.gamma, p.gamma + 1], PROBE_REPS, sp=p.sp)
  return {"t_target": ts[1].median, "t_target_gamma": ts[p.gamma].median,
          "t_verify": ts[p.gamma + 1].median,
          "t_draft": bench.probe_d.times([1], PROBE_REPS, sp=p.sp)[1].median}


def run_point(bench: Bench, p: Point) -> Record:
  """Measures one point and its predictions.

  Each repetition runs target-only and speculative generation (each over
  every prompt, one after another, batch 1; the order alternates between
  repetitions), then the cost probes, and pairs them: its speedup is the
  ratio of its two runs, its prediction comes from the probes taken right
  after them, and its efficiency is their ratio. The machine's speed drifts
  over seconds; pairing within a repetition cancels the drift that a ratio
  of medians taken apart would keep. Reported: the median over repetitions
  of each (speed and costs too). Tokens/s pool all prompts; so do the
  acceptance statistics (identical in every repetition: same seed).
  """
  sc = speculative.SpecConfig(bench.target.cfg, bench.draft and bench.draft.cfg, p.gamma, p.sp,
                              acceptance.parse_rule(p.accept_rule).simulated,
                              drafter=bench.drafter)
  split = bool(bench.cfg.measure_split)
  compile_s = bench.warm_up(p, split)  # the probes warm up on their first call
  t_accept = costs.accept_cost(sc, int(bench.cfg.reps)).median
  reps = []
  for rep in range(int(bench.cfg.reps)):
    with CompileWatch() as cw:
      if rep % 2:
        res, b = bench.spec(p), bench.base(p)
      else:
        b, res = bench.base(p), bench.spec(p)
    if cw.count:
      raise SpecjaxError(f"{cw.count} compilation(s) inside timed repetition {rep} of "
                         f"{p.key} ({dict(cw.names)}): shapes changed between runs")
    reps.append({"base_s": sum(r.eval_s for r in b) / sum(r.n_eval for r in b),
                 "spec_s": sum(r.eval_s for r in res) / sum(r.stats.n_kept for r in res),
                 **_rep_costs(bench, p)})
  pooled = stats_lib.Records.concat([r.records for r in res])
  st = stats_lib.SpecStats.compute(pooled, gamma=p.gamma,
                                   n_predict=sum(r.stats.n_predict for r in res))
  for r in reps:
    step = costs.StepCosts(r["t_target"], r["t_target_gamma"], r["t_verify"], r["t_draft"],
                           t_accept)
    r["speedup"] = r["base_s"] / r["spec_s"]
    r["efficiency"] = r["speedup"] / costs.predict(st, step)["predicted_measured_cost"]
  med = lambda k: statistics.median(r[k] for r in reps)
  step_costs = costs.StepCosts(med("t_target"), med("t_target_gamma"), med("t_verify"),
                               med("t_draft"), t_accept)
  return schema.run_record(
      st, gamma=p.gamma, accept_rule=p.accept_rule, temperature=p.sp.temperature,
      top_k=p.sp.top_k, top_p=p.sp.top_p, seed=int(bench.cfg.seed), loop="device",
      capacity=bench.capacity, n_prompts=len(bench.prompts), reps=int(bench.cfg.reps),
      baseline_tps=1 / med("base_s"), spec_tps=1 / med("spec_s"), speedup=med("speedup"),
      t_target_s=step_costs.t_target, t_target_gamma_s=step_costs.t_target_gamma,
      t_verify_s=step_costs.t_verify, t_draft_s=step_costs.t_draft, t_accept_s=t_accept,
      c=step_costs.c, verify_ratio=step_costs.verify_ratio, **costs.predict(st, step_costs),
      efficiency=med("efficiency"), efficiency_reps=[r["efficiency"] for r in reps],
      compile_s=compile_s, geometric=stats_lib.geometric_check(st),
      **(time_split(bench, p) if split else {}))


def time_split(bench: Bench, p: Point) -> dict[str, float]:
  """Shares of the step time per phase, from a run of the host loop (its
  phases compiled by Bench.warm_up)."""
  phase: dict[str, float] = {}
  for r in bench.spec(p, "host"):
    for k, v in r.stats.phase_s.items():
      phase[k] = phase.get(k, 0.0) + v
  total = sum(phase.values())
  return {f"{k[:-2]}_share": v / total for k, v in phase.items()}


def run_sweep(cfg, workdir: str, resume: bool = False, progress: bool = True) -> list[Record]:
  """Runs every point of the config; returns all records (finished + new)."""
  validate(cfg)
  os.makedirs(workdir, exist_ok=True)
  jsonl = os.path.join(workdir, wd.RESULTS)
  done = wd.read_jsonl(jsonl) if resume else []
  if done:
    _check_same_sweep(workdir, cfg)
  wd.restart_jsonl(jsonl, done)  # whole records only: a torn line is dropped
  env = wd.environment()
  wd.write_config(workdir, cfg.to_dict(), env, schema=schema.SCHEMA_VERSION)

  drafter = drafters.parse(cfg.get("drafter", "model"))
  tcfg, tparams, tok = checkpoint.load_model(cfg.target, dtype=cfg.dtype, seed=int(cfg.seed))
  target, draft = steps.Runner(tcfg, tparams), None
  if drafter.needs_draft_model:
    dcfg, dparams, _ = checkpoint.load_model(cfg.draft, dtype=cfg.dtype, seed=int(cfg.seed) + 1,
                                             role="draft")
    speculative.check_vocabularies(tcfg, dcfg)  # before any timing
    draft = steps.Runner(dcfg, dparams)
  # the model the drafter runs (the draft, a layer subset of the target, or none)
  dcfg = drafter.draft_config(tcfg, draft and draft.cfg)
  prompts = sweep_prompts(cfg, tok, tcfg.vocab_size)
  depth = max(len(p) for p in prompts)
  gammas = sorted(int(g) for g in cfg.gammas)
  capacity = generation.plan_capacity(tcfg, depth, int(cfg.n_predict),
                                      extra=max(gammas), ctx_size=int(cfg.ctx_size))
  if dcfg is not None:
    probe_d = costs.CostProbe(steps.Runner(dcfg, drafter.draft_params(tparams, draft)), capacity,
                              depth, k=costs.PROBE_REPEATS)
  else:  # a model-free drafter: its proposal's time / gamma
    probe_d = costs.ProposeProbe(drafter, tcfg, max(gammas), capacity, depth,
                                 k=costs.PROBE_REPEATS)
  bench = Bench(target, draft, prompts, capacity,
                costs.CostProbe(target, capacity, depth, k=costs.PROBE_REPEATS), probe_d, cfg,
                drafter=drafter)
  points = [Point(g, a, SamplingParams(float(t), int(cfg.top_k), float(cfg.top_p)))
            for t in cfg.temps for g in gammas for a in cfg.accepts]
  finished = {point_key(r) for r in done}
  todo = [p for p in points if p.key not in finished]

  curve = costs.measure_curve(bench.probe_t, bench.probe_d, gammas, int(cfg.reps))
  wd.write_json(os.path.join(workdir, "costs.json"), curve.to_dict())
  records = list(done)
  bar = _progress(len(points), len(points) - len(todo), progress)
  t_start = time.perf_counter()
  for i, p in enumerate(todo):
    rec = run_point(bench, p)
    rec.update(target=tcfg.name, draft=dcfg.name if dcfg is not None else None,
               drafter=drafter.spec, precision=tcfg.precision, env=env)
    wd.append_jsonl(jsonl, [rec])
    records.append(rec)
    wd.write_csv(os.path.join(workdir, wd.CSV_FILE), records, schema.CSV_COLUMNS)
    bar.update(1)
    bar.set_postfix_str(f"g={p.gamma} {p.accept_rule} T={p.sp.temperature:g}: "
                        f"{rec['speedup']:.2f}x")
    if not progress:  # logs: one line per point with the time left
      left = (time.perf_counter() - t_start) / (i + 1) * (len(todo) - i - 1)
      print(f"point {len(records)}/{len(points)}: gamma {p.gamma}, {p.accept_rule}, "
            f"T={p.sp.temperature:g}: speedup {rec['speedup']:.3f}x, efficiency "
            f"{rec['efficiency']:.3f}; ~{left / 60:.1f} min left", flush=True)
  bar.close()
  from specjax import sweep_report  # matplotlib only when writing the report
  sweep_report.write_report(workdir, records, curve.to_dict(), env)
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


def _check_same_sweep(workdir: str, cfg) -> None:
  """Resuming into a workdir whose points were measured differently (other
  settings, or an older record schema) is refused."""
  saved = wd.read_config(workdir)
  if saved is None:
    return
  if saved.get("schema") != schema.SCHEMA_VERSION:
    raise ConfigError(f"cannot resume: {workdir} holds results of an older specjax (record "
                      f"schema {saved.get('schema', 1)}, now {schema.SCHEMA_VERSION}); "
                      f"use another --workdir")
  old, new = saved.get("config") or {}, wd.normalised(cfg.to_dict())
  old.setdefault("drafter", "model")  # sweeps from before drafters drafted with the model
  diff = sorted(k for k in set(old) | set(new)
                if k not in _POINT_FIELDS and old.get(k) != new.get(k))
  if diff:
    raise ConfigError(f"cannot resume: the workdir's sweep used different settings for "
                      f"{', '.join(diff)}; use another --workdir or the same config")


def _progress(total: int, initial: int, enabled: bool):
  from tqdm import tqdm  # pylint: disable=import-outside-toplevel
  return tqdm(total=total, initial=initial, desc="sweep points", unit="pt",
              disable=not enabled, dynamic_ncols=True)
