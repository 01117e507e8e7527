"""Batched speculative decoding, PyTorch vs specjax (XLA), on the same weights.

  python experiments/torch_spec_bench.py --batch=1,2,4,8 --gamma=1,2,4 \
      --rules=bernoulli:0.8,always --n_predict=32 --jsonl_out=/tmp/ts.jsonl

For every (B, gamma, rule), each engine runs target-only and speculative
greedy generation of n_predict tokens for B ragged prompts (lengths
prompt_len, prompt_len - 2, ...), the two alternating over --reps
repetitions after an untimed warm-up (compile: torch.compile's graphs, XLA's
programs); tokens/s are summed over rows, first token excluded; speedup is
the median of each repetition's ratio (sweep.run_group's pairing).
  torch    backends/torch_spec.TorchSpec: a host loop of torch.compile'd
           forwards (T = 1 decode and draft, T = gamma + 1 verify).
  specjax  speculative.generate / generation.generate (device loops).
Threads: on a shared machine give both engines one thread
(XLA_FLAGS=--xla_cpu_multi_thread_eigen=false and --threads=1): an OpenMP
pool of 2 threads on 2 loaded cores measured 4-5x slower than 1 thread.
With --costs, T(B, N) for N = 1 and every gamma + 1, one target forward with
the argmax of its logits, k forwards per repetition from the same cache state
(probes.CostProbe's method at batch B; torch dispatches each forward from the
host, specjax runs the k in one jitted loop).
The simulated rules draw their acceptances from different generators (torch
vs JAX): bernoulli points compare engines at the same rule, not the same
draws (n_steps and tokens_per_step are reported for both); `always` emits the
same tokens on both (`tokens_equal`).
With --auto (specjax): per B, the chooser's costs are measured first
(autogamma.measure_costs: T(B, 1), T(B, gamma+1), T_draft(B, 1), the accept
cost), and after the fixed gammas of each rule a point with gamma chosen at
run time from --gamma (autogamma.generate, every chunk program compiled in
the warm-up; then, with --auto_calibrate, each gamma's loop step timed in
one untimed run: autogamma.calibrate), timed with the same pairing.
With --out_dir: summary.md (speedups, crossover batch per engine, rule and
gamma, auto against the best fixed gamma in hindsight, the cost surfaces),
speedup_vs_batch.png (one panel per rule and engine, the 1x line) and
verify_surface_<engine>.png (T(B, N)/T(B, 1)), rewritten after every batch:
an interrupted run keeps the report of every finished batch.
"""

import os
import statistics
import time

from absl import flags
import jax
import numpy as np

from specjax.decode import autogamma
from specjax.formats import checkpoint
from specjax import cli
from specjax.model import config
from specjax.decode import probes
from specjax.decode import generation
from specjax.decode import speculative
from specjax.model import steps
from specjax.bench import sweep_report
from specjax.metrics import timing
from specjax import workdir as wd
from specjax.bench.backends import torch_spec as ts
from specjax.errors import ConfigError
from specjax.model.sampling import SamplingParams

_TARGET = flags.DEFINE_string("target", "cpu-target", "Target: preset, HF or orbax directory.")
_DRAFT = flags.DEFINE_string("draft", "cpu-draft", "Draft: preset, HF or orbax directory.")
_DTYPE = flags.DEFINE_string("dtype", "float32", "Compute and parameter dtype.")
_BATCH = flags.DEFINE_list("batch", ["1", "2", "4", "8"], "Batch sizes B.")
_GAMMA = flags.DEFINE_list("gamma", ["1", "2", "4"], "Draft lengths gamma.")
_RULES = flags.DEFINE_list("rules", ["bernoulli:0.8", "always"], "Acceptance rules.")
_N_PREDICT = flags.DEFINE_integer("n_predict", 32, "Tokens per row (first included).", lower_bound=1)
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 16, "Longest prompt; rows are ragged.", lower_bound=7)
_REPS = flags.DEFINE_integer("reps", 3, "Timed repetitions (alternating).", lower_bound=1)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of weights, prompts and acceptance draws.")
_ENGINES = flags.DEFINE_list("engines", ["torch", "specjax"], "torch and/or specjax.")
_COMPILE = flags.DEFINE_bool("compile", True, "torch.compile the torch forwards (else eager).")
_THREADS = flags.DEFINE_integer("threads", 0, "torch threads (0: every core, as XLA).")
_COSTS = flags.DEFINE_bool("costs", True, "Also measure T(B, N), N = 1 and gamma + 1.")
_K = flags.DEFINE_integer("k", 4, "Forwards per cost repetition.", lower_bound=1)
_AUTO = flags.DEFINE_bool("auto", True, "specjax: also gamma chosen at run time from --gamma.")
_AUTO_EVERY = flags.DEFINE_integer("auto_every", autogamma.EVERY,
                                   "Steps between auto gamma choices (once warmed in).",
                                   lower_bound=1)
_CALIBRATE = flags.DEFINE_bool("auto_calibrate", True, "Auto gamma: time each gamma's loop "
                                "step after the warm-up (autogamma.calibrate) before choosing.")
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Write summary.md and the plots here.")
_OUT = cli.RecordFlags("point")


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
  """The specjax side of ts.time_point: same pairing, same fields."""
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

    def run(tokens=tokens):
      acc, holder[0] = probes.repeat_forward(m.params, tokens, holder[0],
                                             jax.random.PRNGKey(n), cfg=m.cfg, k=k,
                                             sp=SamplingParams())
      return acc
    t = timing.measure(run, reps=reps, warmup=1)
    out[n] = [x / k for x in t.times]
  return out


def auto_point(target, draft, prompts, n_predict, gammas, rule, reps, seed, cap, bc, every,
               calibrate=True):
  """The specjax auto-gamma point: same pairing and fields as specjax_point
  (with `calibrate`, each gamma's loop step is timed after the warm-up,
  untimed for the point: autogamma.calibrate)."""
  kw = dict(rule=rule, seed=seed, capacity=cap, every=every)
  base = lambda: generation.generate(target, prompts, n_predict, seed=seed, capacity=cap)
  spec = lambda: autogamma.generate(target, draft, prompts, n_predict, bc, gammas, **kw)

  def warm():
    nonlocal bc
    base()
    autogamma.warm_up(target, draft, prompts, n_predict, bc, gammas, **kw)
    if calibrate:  # untimed for the point, after the compiles
      bc = autogamma.calibrate(target, draft, prompts, n_predict, bc, gammas, **kw)

  rows, res, _, warmup_s, compile_s = _timed(base, spec, warm, reps, len(prompts))
  return {**_fields(prompts, n_predict, "auto", rule, reps, seed, cap, rows, res, warmup_s,
                    compile_s),
          "auto_set": list(gammas), "auto_every": every,
          "gammas_used": {str(g): res.gammas_used.count(g) for g in gammas},
          "auto_costs": bc.to_dict()}


def _row(r):
  return (f"B={r['batch']} gamma={r['gamma']} {r['accept_rule']:<13} {r['engine']:<13} "
          f"base {r['baseline_tps']:7.1f} t/s  spec {r['spec_tps']:7.1f} t/s  "
          f"speedup {r['speedup']:5.2f}  tokens/step {r['tokens_per_step']:.2f}  "
          f"loop steps {r['n_loop']}")


def table(records):
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
        b = sweep_report.crossover(pts_e)
        cells.append("-" if not pts_e else f"B = {b}" if b else
                     f"none (>= 1x up to B = {max(p[0] for p in pts_e)})")
      out.append(f"| {rule} | {g} | " + " | ".join(cells) + " |")
  if auto:
    sj = {(r["batch"], r["accept_rule"], r["gamma"]): r["speedup"] for r in fixed
          if _engine(r) == "specjax"}
    tps = {(r["batch"], r["accept_rule"], r["gamma"]): r["spec_tps"] for r in fixed
           if _engine(r) == "specjax"}
    out += ["", "## Auto gamma (specjax) against the fixed gammas", "",
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
              ", ".join(f"gamma {g}: {sweep_report._gmean(v):.3f}"  # pylint: disable=protected-access
                        for g, v in per_gamma.items() if v) +
              (" (auto beats every single fixed gamma across the sweep)." if all(
                  sweep_report._gmean(v) > 1 for v in per_gamma.values() if v)  # pylint: disable=protected-access
               else " (some fixed gamma beats auto across the sweep).")]
  return "\n".join(out) + "\n"


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
      sweep_report.plot_verify_surface(os.path.join(out_dir, f"verify_surface_{e}.png"), bs, ns,
                                       ratio, f"{_label(e)}, {prec}: verify cost T(B, n) / T(B, 1)")


def main(argv):
  del argv
  batches = sorted({int(x) for x in _BATCH.value})
  gammas = sorted({int(x) for x in _GAMMA.value})
  engines = set(_ENGINES.value)
  if not engines or engines - {"torch", "specjax"}:
    raise ConfigError(f"--engines must name torch and/or specjax, got {_ENGINES.value}")
  if min(batches) < 1 or min(gammas) < 1:
    raise ConfigError("--batch and --gamma must be >= 1")
  dtype = config.canonical_precision(_DTYPE.value)
  tcfg, tparams, _ = checkpoint.load_model(_TARGET.value, dtype=dtype, seed=_SEED.value)
  dcfg, dparams, _ = checkpoint.load_model(_DRAFT.value, dtype=dtype, seed=_SEED.value + 1,
                                           role="draft")
  speculative.check_vocabularies(tcfg, dcfg)
  threads = _THREADS.value or os.cpu_count()
  env = {**wd.environment(), "torch_threads": threads}
  records = []
  emit = _OUT.on_record(lambda r: _row(r) if r["kind"] == "point" else
                        f"B={r['batch']} N={r['n_tokens']} {r['engine']}: T "
                        f"{1e3 * r['median_s']:.2f} ms, ratio {r['ratio']:.2f}"
                        if r["kind"] == "cost" else
                        f"B={r['batch']} auto gamma costs: T_target(n) ms " + ", ".join(
                            f"{n}: {1e3 * t:.2f}" for n, t in r["t_target_s"].items()) +
                        f"; T_draft {1e3 * r['t_draft_s']:.2f} ms")

  def record(r):
    r.update(target=tcfg.name, draft=dcfg.name, precision=tcfg.precision,
             load_avg=wd.load_avg(), env=env)
    records.append(r)
    emit(r)

  engine = (ts.make_engine(tcfg, tparams, dcfg, dparams, compile=_COMPILE.value,
                           threads=threads) if "torch" in engines else None)
  target, draft = steps.Runner(tcfg, tparams), steps.Runner(dcfg, dparams)
  rng = np.random.RandomState(_SEED.value)
  n = _N_PREDICT.value
  for bsz in batches:
    prompts = [rng.randint(0, tcfg.vocab_size, _PROMPT_LEN.value - 2 * (i % 4)).tolist()
               for i in range(bsz)]
    cap = generation.plan_capacity(tcfg, _PROMPT_LEN.value, n, extra=max(gammas))
    bc = None
    if _AUTO.value and "specjax" in engines:  # the chooser's costs, measured before its runs
      bc = autogamma.measure_costs(target, draft, bsz, cap, _PROMPT_LEN.value, gammas,
                                   rule=_RULES.value[0], reps=_REPS.value)
      record({"kind": "batch_costs", **bc.to_dict()})
    for rule in _RULES.value:
      for gamma in gammas:
        got = {}
        if "torch" in engines:
          r = ts.time_point(engine, prompts, n, gamma, rule, _REPS.value, _SEED.value, cap)
          if rule == "always":
            got["torch"] = engine.generate(prompts, n, gamma, rule=rule, seed=_SEED.value,
                                           capacity=cap).tokens
          record({"kind": "point", "threads": threads, **r})
        if "specjax" in engines:
          r, toks, base_toks = specjax_point(target, draft, prompts, n, gamma, rule,
                                             _REPS.value, _SEED.value, cap)
          if "torch" in got and rule == "always":  # simulated draws differ otherwise
            r["tokens_equal"] = got["torch"] == toks
          if "torch" in engines and gamma == gammas[0] and rule == _RULES.value[0]:
            r["baseline_tokens_equal"] = (  # once per batch size
                engine.generate_target(prompts, n, capacity=cap).tokens == base_toks)
          record({"kind": "point", **r})
      if bc is not None:
        record({"kind": "point", **auto_point(target, draft, prompts, n, gammas, rule,
                                              _REPS.value, _SEED.value, cap, bc,
                                              _AUTO_EVERY.value, _CALIBRATE.value)})
    if _COSTS.value:
      ns = sorted({1} | {g + 1 for g in gammas})
      depth = _PROMPT_LEN.value
      got = {}
      if "torch" in engines:
        probe = ts.TorchCostProbe(engine.target, bsz, cap, depth, _SEED.value, k=_K.value)
        got["torch" + ("-compile" if engine.target.compiled else "-eager")] = {
            m: t.times for m, t in probe.times(ns, _REPS.value).items()}
      if "specjax" in engines:
        got["specjax"] = specjax_costs(target, bsz, cap, depth, ns, _REPS.value, _K.value,
                                       _SEED.value)
      for name, ts_ in got.items():
        t1 = statistics.median(ts_[1])
        for m in ns:
          med = statistics.median(ts_[m])
          record({"kind": "cost", "engine": name, "batch": bsz, "n_tokens": m, "depth": depth,
                  "capacity": cap, "times_s": ts_[m], "median_s": med, "ratio": med / t1})
    if _OUT_DIR.value:
      write_report(_OUT_DIR.value, records)
  print(table(records))
  _OUT.finish(records)


if __name__ == "__main__":
  cli.run(main)
