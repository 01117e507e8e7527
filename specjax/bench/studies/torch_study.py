"""The batched PyTorch-vs-specjax study of experiments/torch_spec_bench.py:
its runner (`run`: Settings in, records out) and its report (`table`,
`summary`, `plot_speedups`, `write_report`: records in, text and files out).

The records are the study's whole state: every report function takes the
list `run` returns (or a --jsonl_out read back) and nothing else, so a report
can be rewritten from a finished or interrupted run. Each point record keeps
its rows (prompt ids, speculative tokens, target-only tokens), so a point's
output can be checked and reused. The method is described in the script's
docstring.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from specjax import cli
from specjax import workdir as wd
from specjax.bench.sweep import batch_report
from specjax.bench.sweep import engine as sweep_engine
from specjax.bench.backends import torch_spec as ts
from specjax.decode import generation
from specjax.decode import probes
from specjax.decode import speculative
from specjax.errors import ConfigError
from specjax.formats import checkpoint
from specjax.metrics import timing
from specjax.model import config
from specjax.model import steps
from specjax.model.sampling import SamplingParams

ENGINES = ("torch", "specjax")


@dataclasses.dataclass(frozen=True)
class Settings:
  """What one study runs (the script's flags, parsed)."""
  model: str = "cpu-target"
  model_draft: str = "cpu-draft"
  dtype: str = "float32"
  batches: Sequence[int] = (1, 2, 4, 8)
  gammas: Sequence[int] = (1, 2, 4)   # the fixed gammas
  auto: bool = True                   # specjax: also gamma chosen at run time from `gammas`
  rules: Sequence[str] = ("bernoulli:0.8", "always")
  n_predict: int = 32
  prompt_len: int = 16
  reps: int = 3
  seed: int = 0
  engines: Sequence[str] = ENGINES
  compile: bool = True                # torch.compile the torch forwards (else eager)
  threads: int = 0                    # torch threads; 0: every core
  costs: bool = True                  # also T(B, N), N = 1 and gamma + 1
  k: int = 4                          # forwards per cost repetition
  auto_every: int = sweep_engine.GAMMA_EVERY
  calibrate: bool = True
  out_dir: str | None = None          # summary.md and plots, rewritten after every batch

  def check(self) -> None:
    """Refuses settings the study cannot run (one line)."""
    if not self.engines or set(self.engines) - set(ENGINES):
      raise ConfigError(f"--engines must name torch and/or specjax, got {list(self.engines)}")
    if not self.batches or not self.gammas or min(self.batches) < 1 or min(self.gammas) < 1:
      raise ConfigError("--batch and --gamma must be >= 1")
    if not self.rules:
      raise ConfigError("--rules is empty")


# ---------------------------------------------------------------- the runner


class _KeepTokens:
  """A torch engine that keeps the tokens of its last generate and
  generate_target calls (ts.time_point returns timings only; its timed
  repetitions' outputs become the point's rows at no extra run)."""

  def __init__(self, engine: ts.TorchSpec):
    self.engine, self.spec_tokens, self.base_tokens = engine, None, None

  def __getattr__(self, name):
    return getattr(self.engine, name)

  def generate(self, *args, **kwargs):
    res = self.engine.generate(*args, **kwargs)
    self.spec_tokens = res.tokens
    return res

  def generate_target(self, *args, **kwargs):
    res = self.engine.generate_target(*args, **kwargs)
    self.base_tokens = res.tokens
    return res


def _timed(base, spec, warm, reps, n_rows):
  """warm() untimed (compiles), then ts.paired_reps; raises if anything
  compiles in the timed repetitions. Returns (rows, last spec, last base,
  warm-up seconds, compile seconds)."""
  t0 = time.perf_counter()
  with timing.CompileWatch() as cw:
    warm()
  warmup_s = time.perf_counter() - t0
  with timing.CompileWatch() as late:
    rows, res, b = ts.paired_reps(base, spec, reps, n_rows)
  if late.count:
    raise RuntimeError(f"{late.count} compilation(s) inside timed repetitions")
  return rows, res, b, warmup_s, cw.seconds


def _fields(prompts, n_predict, gamma, rule, reps, seed, cap, rows, res, warmup_s, compile_s):
  st = res.stats
  return {"engine": "specjax", "batch": len(prompts), "gamma": gamma,
          "accept_rule": rule, "n_predict": n_predict, "capacity": cap, "reps": reps,
          "seed": seed, **ts.point_fields(rows, st),
          "n_loop": int(res.records.steps_per_row().max()) if st.n_steps else 0,
          "warmup_s": warmup_s, "compile_s": compile_s}


def specjax_point(target, draft, prompts, n_predict, gamma, rule, reps, seed, cap):
  """The specjax side of ts.time_point: same pairing, same fields. Returns
  (fields, the last speculative tokens, the last target-only tokens)."""
  base = lambda: generation.generate(target, prompts, n_predict, seed=seed, capacity=cap)
  spec = lambda: speculative.generate(target, draft, prompts, n_predict, gamma, rule=rule,
                                      seed=seed, capacity=cap)
  rows, res, b, warmup_s, compile_s = _timed(base, spec, lambda: (base(), spec()), reps,
                                             len(prompts))
  return (_fields(prompts, n_predict, gamma, rule, reps, seed, cap, rows, res, warmup_s,
                  compile_s), res.tokens, b.tokens)


def specjax_costs(m, batch, cap, depth, ns, reps, k, seed):
  """T(B, n) per forward: probes.CostProbe's jitted loop of k forwards, batch B."""
  rng = np.random.RandomState(seed)
  holder = [probes.filled_cache(m, batch, cap, depth, rng)]
  out = {}
  for n in sorted(set(ns)):
    tokens = probes.random_tokens(rng, m.cfg.vocab_size, batch, n)

    def run_k(tokens=tokens):
      acc, holder[0] = probes.repeat_forward(m.params, tokens, holder[0],
                                             jax.random.PRNGKey(n), cfg=m.cfg, k=k,
                                             sp=SamplingParams())
      return acc
    t = timing.measure(run_k, reps=reps, warmup=1)
    out[n] = [x / k for x in t.times]
  return out


def auto_point(target, draft, prompts, n_predict, gammas, rule, reps, seed, cap, bc, every,
               calibrate=True):
  """The specjax auto-gamma point: same pairing and fields as specjax_point
  (with `calibrate`, each gamma's loop step is timed after the warm-up,
  untimed for the point: autogamma.calibrate). Returns (fields, the last
  speculative tokens, the last target-only tokens)."""
  loop, sp = sweep_engine.Loop(target, draft, cap, n_predict, seed), SamplingParams()
  base = lambda: loop.target_only(prompts, sp)
  spec = lambda: loop.auto_chain(prompts, bc, gammas, sp, rule, "model", every)

  def warm():
    nonlocal bc
    base()
    loop.warm_chain(prompts, gammas, sp, rule, "model", every)
    if calibrate:  # untimed for the point, after the compiles
      bc = loop.calibrate_chain(prompts, bc, gammas, sp, rule, "model", every)

  rows, res, b, warmup_s, compile_s = _timed(base, spec, warm, reps, len(prompts))
  used = sweep_engine.gammas_chosen([res])
  return ({**_fields(prompts, n_predict, "auto", rule, reps, seed, cap, rows, res, warmup_s,
                     compile_s),
           "auto_set": list(gammas), "auto_every": every,
           "gammas_used": {str(g): used.count(g) for g in gammas},
           "auto_costs": bc.to_dict()}, res.tokens, b.tokens)


def run(s: Settings, on_record: Callable[[dict[str, Any]], None] = lambda r: None
        ) -> list[dict[str, Any]]:
  """The study: per batch B (B ragged random prompts), per rule and gamma,
  each engine's paired point; per B the auto point and the cost probes.
  Calls on_record with each record as it is finished; with s.out_dir, the
  report is rewritten after every batch. Returns every record."""
  s.check()
  batches, gammas, engines = sorted(set(s.batches)), sorted(set(s.gammas)), set(s.engines)
  dtype = config.canonical_precision(s.dtype)
  tcfg, tparams, _ = checkpoint.load_model(s.model, dtype=dtype, seed=s.seed)
  dcfg, dparams, _ = checkpoint.load_model(s.model_draft, dtype=dtype, seed=s.seed + 1,
                                           role="draft")
  sweep_engine.check_vocabularies(tcfg, dcfg)
  threads = s.threads or os.cpu_count()
  env = {**wd.environment(), "torch_threads": threads}
  records = []

  def record(r):
    r.update(target=tcfg.name, draft=dcfg.name, precision=tcfg.precision,
             load_avg=wd.load_avg(), env=env)
    records.append(r)
    on_record(r)

  engine = (_KeepTokens(ts.make_engine(tcfg, tparams, dcfg, dparams, compile=s.compile,
                                       threads=threads)) if "torch" in engines else None)
  target, draft = steps.Runner(tcfg, tparams), steps.Runner(dcfg, dparams)
  rng = np.random.RandomState(s.seed)
  n = s.n_predict
  for bsz in batches:
    prompts = [rng.randint(0, tcfg.vocab_size, s.prompt_len - 2 * (i % 4)).tolist()
               for i in range(bsz)]
    cap = generation.plan_capacity(tcfg, s.prompt_len, n, extra=max(gammas))
    bc = None
    if s.auto and "specjax" in engines:  # the chooser's costs, measured before its runs
      bc = sweep_engine.Loop(target, draft, cap, n, s.seed).gamma_costs(
          bsz, s.prompt_len, gammas, SamplingParams(), s.rules[0], "model", s.reps)
      record({"kind": "batch_costs", **bc.to_dict()})
    for rule in s.rules:
      for gamma in gammas:
        got = {}
        if "torch" in engines:
          r = ts.time_point(engine, prompts, n, gamma, rule, s.reps, s.seed, cap)
          got["torch"], got["torch_base"] = engine.spec_tokens, engine.base_tokens
          record({"kind": "point", "threads": threads, **r,
                  "rows": cli.row_records(prompts, engine.spec_tokens, engine.base_tokens)})
        if "specjax" in engines:
          r, toks, base_toks = specjax_point(target, draft, prompts, n, gamma, rule,
                                             s.reps, s.seed, cap)
          if "torch" in got and rule == "always":  # simulated draws differ otherwise
            r["tokens_equal"] = got["torch"] == toks
          if "torch" in engines and gamma == gammas[0] and rule == s.rules[0]:
            r["baseline_tokens_equal"] = got["torch_base"] == base_toks  # once per batch size
          record({"kind": "point", **r, "rows": cli.row_records(prompts, toks, base_toks)})
      if bc is not None:
        r, toks, base_toks = auto_point(target, draft, prompts, n, gammas, rule, s.reps, s.seed,
                                        cap, bc, s.auto_every, s.calibrate)
        record({"kind": "point", **r, "rows": cli.row_records(prompts, toks, base_toks)})
    if s.costs:
      ns = sorted({1} | {g + 1 for g in gammas})
      depth = s.prompt_len
      got = {}
      if "torch" in engines:
        probe = ts.TorchCostProbe(engine.target, bsz, cap, depth, s.seed, k=s.k)
        got["torch" + ("-compile" if engine.target.compiled else "-eager")] = {
            m: t.times for m, t in probe.times(ns, s.reps).items()}
      if "specjax" in engines:
        got["specjax"] = specjax_costs(target, bsz, cap, depth, ns, s.reps, s.k, s.seed)
      for name, times in got.items():
        t1 = statistics.median(times[1])
        for m in ns:
          med = statistics.median(times[m])
          record({"kind": "cost", "engine": name, "batch": bsz, "n_tokens": m, "depth": depth,
                  "capacity": cap, "times_s": times[m], "median_s": med, "ratio": med / t1})
    if s.out_dir:
      write_report(s.out_dir, records)
  return records


# ---------------------------------------------------------------- the report


def progress_row(r: dict[str, Any]) -> str:
  """One stderr line per finished record."""
  if r["kind"] == "point":
    return (f"B={r['batch']} gamma={r['gamma']} {r['accept_rule']:<13} {r['engine']:<13} "
            f"base {r['baseline_tps']:7.1f} t/s  spec {r['spec_tps']:7.1f} t/s  "
            f"speedup {r['speedup']:5.2f}  tokens/step {r['tokens_per_step']:.2f}  "
            f"loop steps {r['n_loop']}")
  if r["kind"] == "cost":
    return (f"B={r['batch']} N={r['n_tokens']} {r['engine']}: T "
            f"{1e3 * r['median_s']:.2f} ms, ratio {r['ratio']:.2f}")
  return (f"B={r['batch']} auto gamma costs: T_target(n) ms " + ", ".join(
      f"{n}: {1e3 * t:.2f}" for n, t in r["t_target_s"].items()) +
          f"; T_draft {1e3 * r['t_draft_s']:.2f} ms")


def table(records) -> str:
  """The point table (both engines side by side) and the cost table."""
  pts = [r for r in records if r.get("kind") == "point"]
  keys = sorted({(r["batch"], r["gamma"], r["accept_rule"]) for r in pts},
                key=lambda k: (k[0], k[2], k[1] == "auto", k[1] if k[1] != "auto" else 0))
  by = {(r["batch"], r["gamma"], r["accept_rule"], r["engine"].split("-")[0]): r for r in pts}
  lines = ["| B | gamma | rule | torch base t/s | torch spec t/s | torch speedup | torch tok/step "
           "| specjax base t/s | specjax spec t/s | specjax speedup | specjax tok/step |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  cell = lambda r, f, fmt: format(r[f], fmt) if r else "-"
  for key in keys:
    t, j = by.get(key + ("torch",)), by.get(key + ("specjax",))
    lines.append(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(
        [cell(t, "baseline_tps", ".1f"), cell(t, "spec_tps", ".1f"), cell(t, "speedup", ".2f"),
         cell(t, "tokens_per_step", ".2f"), cell(j, "baseline_tps", ".1f"),
         cell(j, "spec_tps", ".1f"), cell(j, "speedup", ".2f"),
         cell(j, "tokens_per_step", ".2f")]) + " |")
  cs = [r for r in records if r.get("kind") == "cost"]
  if cs:
    lines += ["", "| B | N | engine | T(B,N) ms | T(B,N)/T(B,1) |", "|---|---|---|---|---|"]
    for r in cs:
      lines.append(f"| {r['batch']} | {r['n_tokens']} | {r['engine']} | "
                   f"{1e3 * r['median_s']:.2f} | {r['ratio']:.2f} |")
  return "\n".join(lines)


def _engine(r) -> str:
  return r["engine"].split("-")[0]


def _label(engine: str) -> str:
  return "XLA (specjax)" if engine == "specjax" else f"PyTorch ({engine})"


def _gmean(xs) -> float:
  """Geometric mean of the positive values (batch_report's, for the same figures)."""
  xs = [x for x in xs if x and x > 0]
  return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def summary(records) -> str:
  """summary.md: the point and cost tables, crossover, auto vs fixed."""
  pts = [r for r in records if r.get("kind") == "point"]
  fixed = [r for r in pts if r["gamma"] != "auto"]
  auto = [r for r in pts if r["gamma"] == "auto"]
  env = records[0].get("env") if records else None
  head = records[0] if records else {}
  out = [f"# Batched speculative decoding: PyTorch vs specjax (XLA), {head.get('target')} / "
         f"{head.get('draft')}, {head.get('precision')}", "",
         f"Machine: {wd.machine_line(env or wd.environment())}.", "",
         "Speedup = median over alternating repetitions of (target-only time / speculative "
         "time), both engines on the same B ragged rows, tokens/s summed over rows.", "",
         table(records), ""]
  engines = sorted({_engine(r) for r in fixed})
  rules = list(dict.fromkeys(r["accept_rule"] for r in fixed))
  gammas = sorted({r["gamma"] for r in fixed})
  out += ["## Crossover: the first batch where speculative decoding is slower (speedup < 1)", "",
          "| rule | gamma | " + " | ".join(engines) + " |",
          "|---|---|" + "---|" * len(engines)]
  for rule in rules:
    for g in gammas:
      cells = []
      for e in engines:
        pts_e = [(r["batch"], r["speedup"]) for r in fixed
                 if (_engine(r), r["accept_rule"], r["gamma"]) == (e, rule, g)]
        b = batch_report.crossover(pts_e)
        cells.append("-" if not pts_e else f"B = {b}" if b else
                     f"none (>= 1x up to B = {max(p[0] for p in pts_e)})")
      out.append(f"| {rule} | {g} | " + " | ".join(cells) + " |")
  if auto:
    out += _auto_section(fixed, auto, gammas)
  return "\n".join(out) + "\n"


def _auto_section(fixed, auto, gammas) -> list[str]:
  """Auto gamma against the best fixed gamma in hindsight, per point."""
  sj = {(r["batch"], r["accept_rule"], r["gamma"]): r["speedup"] for r in fixed
        if _engine(r) == "specjax"}
  tps = {(r["batch"], r["accept_rule"], r["gamma"]): r["spec_tps"] for r in fixed
         if _engine(r) == "specjax"}
  out = ["", "## Auto gamma (specjax) against the fixed gammas", "",
         "Per point: auto's speedup over the best fixed gamma in hindsight (goal >= 0.95).", "",
         "| B | rule | auto | gammas used (steps) | best fixed gamma | its speedup | auto / best |",
         "|---|---|---|---|---|---|---|"]
  ratios, per_gamma, by_tps = [], {g: [] for g in gammas}, []
  for r in auto:
    fx = {g: sj[(r["batch"], r["accept_rule"], g)] for g in gammas
          if (r["batch"], r["accept_rule"], g) in sj}
    if not fx:
      continue
    best = max(fx, key=fx.get)
    ratios.append(r["speedup"] / fx[best])
    ft = [tps[(r["batch"], r["accept_rule"], g)] for g in fx]
    by_tps.append(r["spec_tps"] / max(ft))
    for g, v in fx.items():
      per_gamma[g].append(r["speedup"] / v)
    used = " ".join(f"{g}:{n}" for g, n in r["gammas_used"].items() if n)
    out.append(f"| {r['batch']} | {r['accept_rule']} | {r['speedup']:.2f} | {used} | {best} | "
               f"{fx[best]:.2f} | {ratios[-1]:.3f} |")
  if ratios:
    within = sum(x >= 0.95 for x in ratios)
    out += ["", f"auto / best fixed: median {statistics.median(ratios):.3f}, min "
            f"{min(ratios):.3f}, within 5 % at {within} of {len(ratios)} points.",
            "By speculative tokens/s alone (auto's over the fastest fixed gamma's at the same "
            "point: no baseline, whose own noise enters every speedup): median "
            f"{statistics.median(by_tps):.3f}, min {min(by_tps):.3f}, within 5 % at "
            f"{sum(x >= 0.95 for x in by_tps)} of {len(by_tps)} points.",
            "Geometric mean over the points of auto's speedup / each fixed gamma's: " +
            ", ".join(f"gamma {g}: {_gmean(v):.3f}" for g, v in per_gamma.items() if v) +
            (" (auto beats every single fixed gamma across the sweep)." if all(
                _gmean(v) > 1 for v in per_gamma.values() if v)
             else " (some fixed gamma beats auto across the sweep).")]
  return out


def plot_speedups(path: str, records) -> None:
  """Speedup against B: one panel per (rule, engine), one line per gamma,
  auto as black stars, the 1x line."""
  plt = wd.pyplot()
  pts = [r for r in records if r.get("kind") == "point"]
  rules = list(dict.fromkeys(r["accept_rule"] for r in pts))
  engines = sorted({r["engine"] for r in pts}, key=lambda e: (e != "specjax", e))
  gammas = sorted({r["gamma"] for r in pts if r["gamma"] != "auto"})
  colors = plt.cm.viridis(np.linspace(0, 0.9, max(len(gammas), 1)))
  fig, axes = plt.subplots(len(rules), len(engines), figsize=(6 * len(engines), 4.5 * len(rules)),
                           squeeze=False, sharey=True)
  for i, rule in enumerate(rules):
    for j, e in enumerate(engines):
      ax = axes[i][j]
      for g, col in zip(gammas, colors):
        ps = sorted((r for r in pts if (r["engine"], r["accept_rule"], r["gamma"]) == (e, rule, g)),
                    key=lambda r: r["batch"])
        ax.plot([r["batch"] for r in ps], [r["speedup"] for r in ps], "o-", color=col,
                label=f"gamma {g}")
      ps = sorted((r for r in pts if (r["engine"], r["accept_rule"], r["gamma"]) ==
                   (e, rule, "auto")), key=lambda r: r["batch"])
      if ps:
        ax.plot([r["batch"] for r in ps], [r["speedup"] for r in ps], "k*", ms=11,
                label="auto gamma")
      ax.axhline(1.0, color="red", lw=1, ls="--", label="1x (no gain)")
      ax.set_xscale("log", base=2)
      ax.set_xlabel("batch B (rows)")
      ax.set_ylabel("speedup over target-only at the same B (x)")
      prec = next((r.get("precision") for r in pts if r["engine"] == e), "")
      ax.set_title(f"{_label(e)}, {prec}: {rule}")
      ax.grid(alpha=0.3, which="both")
      ax.legend(fontsize=7)
  wd.save_figure(fig, path)


def write_report(out_dir: str, records) -> None:
  """summary.md, speedup_vs_batch.png and verify_surface_<engine>.png (where
  every (B, N) of the engine was measured) in out_dir."""
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "summary.md"), "w", encoding="utf-8") as f:
    f.write(summary(records))
  if any(r.get("kind") == "point" for r in records):
    plot_speedups(os.path.join(out_dir, "speedup_vs_batch.png"), records)
  cs = [r for r in records if r.get("kind") == "cost"]
  for e in sorted({r["engine"] for r in cs}):
    er = [r for r in cs if r["engine"] == e]
    bs, ns = sorted({r["batch"] for r in er}), sorted({r["n_tokens"] for r in er})
    got = {(r["batch"], r["n_tokens"]): r["ratio"] for r in er}
    if all((b, n) in got for b in bs for n in ns):
      ratio = np.array([[got[(b, n)] for n in ns] for b in bs])
      prec = er[0].get("precision", "")
      batch_report.plot_verify_surface(os.path.join(out_dir, f"verify_surface_{e}.png"), bs, ns,
                                       ratio, f"{_label(e)}, {prec}: verify cost T(B, n) / T(B, 1)")
