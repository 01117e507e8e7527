"""batch_scaling's outputs: the flat region and cliffs of each curve, the
speedup it allows, results.csv, scaling.png, decode.png, summary.md and
parity.json (definitions: specjax.bench.studies.batch_scaling)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Sequence

from specjax.bench import tables
from specjax.model import kv_cache as kvc
from specjax.metrics import theory
from specjax import workdir as wd
from specjax.bench.backends import BACKENDS

from specjax.workdir import Record

FLAT_LIMIT = 1.25  # T(N)/T(1) above this: out of the flat region
CLIFF_STEP = 1.5   # T(N)/T(N_prev) above this and above N/N_prev: a cliff
SUMMARY_NS = (2, 4, 8, 16, 64)
CSV_COLUMNS = ("model", "dtype", "depth", "batch", "backend", "n_tokens",
               "median_ms", "std_ms", "min_ms", "ratio", "tps", "reps",
               "compile_s", "first_call_s", "cpu_util", "capacity", "threads",
               "load_1m")


def scaling_report(curve: dict[int, float]) -> tuple[int | None, list[tuple[int, int, float]]]:
  """(smallest N with T(N)/T(1) > FLAT_LIMIT or None, cliffs as
  (N_prev, N, T(N)/T(N_prev)) with that step > max(CLIFF_STEP, N/N_prev))."""
  ns = sorted(curve)
  leave = next((n for n in ns if curve[n] / curve[ns[0]] > FLAT_LIMIT), None)
  cliffs = [(a, b, curve[b] / curve[a]) for a, b in zip(ns, ns[1:])
            if curve[b] / curve[a] > max(CLIFF_STEP, b / a)]
  return leave, cliffs


def allowed_speedup(curve: dict[int, float], alpha: float, gamma: int,
                    c: float) -> float | None:
  """theory.speedup_from_curve at (alpha, gamma), T_draft(1) = c T(1);
  None when the curve does not reach gamma + 1."""
  if not curve or 1 not in curve or max(curve) < gamma + 1:
    return None
  return float(theory.speedup_from_curve(alpha, gamma, c * curve[1], curve))


def _groups(records: Sequence[Record], batch: int = 1) -> dict[tuple, dict[str, dict[int, float]]]:
  """{(model, dtype, depth): {backend: {N: T(N) s}}} at one batch size."""
  out: dict[tuple, dict[str, dict[int, float]]] = {}
  for r in records:
    if r["batch"] == batch:
      key = (r["model"], r["dtype"], r["depth"])
      out.setdefault(key, {}).setdefault(r["backend"], {})[r["n_tokens"]] = r["median_s"]
  return out


def csv_row(r: Record) -> Record:
  """A record's cells under CSV_COLUMNS: times in ms, fixed decimals."""
  return {"model": r["model"], "dtype": r["dtype"], "depth": r["depth"],
          "batch": r["batch"], "backend": r["backend"], "n_tokens": r["n_tokens"],
          "median_ms": f"{1e3 * r['median_s']:.4f}", "std_ms": f"{1e3 * r['std_s']:.4f}",
          "min_ms": f"{1e3 * r['min_s']:.4f}",
          "ratio": None if r["ratio"] is None else f"{r['ratio']:.4f}",
          "tps": f"{r['tps']:.3f}", "reps": r["reps"], "compile_s": f"{r['compile_s']:.3f}",
          "first_call_s": None if r["first_call_s"] is None else f"{r['first_call_s']:.3f}",
          "cpu_util": f"{r['cpu_util']:.2f}", "capacity": r["capacity"],
          "threads": r["threads"],
          "load_1m": None if not r["load_avg"] else f"{r['load_avg'][0]:.2f}"}


def plot_scaling(path: str, records: Sequence[Record]) -> None:
  """T(N)/T(1) against N (B = 1), a panel per model/dtype/depth, a line per
  backend, with the linear-cost line N and the ideal flat line 1."""
  plt = wd.pyplot()
  from matplotlib import ticker  # pylint: disable=import-outside-toplevel
  groups = _groups(records)
  cols = min(2, len(groups)) or 1
  rows = -(-len(groups) // cols) or 1
  fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.6 * rows), squeeze=False)
  for ax, ((model, dtype, depth), curves) in zip(axes.flat, groups.items()):
    n_all = sorted({n for cv in curves.values() for n in cv})
    for name, cv in curves.items():
      ns = sorted(cv)
      ax.plot(ns, [cv[n] / cv[ns[0]] for n in ns], "o-", ms=4, label=name)
    ax.plot(n_all, n_all, "--", color="gray", lw=1, label="linear cost: N")
    ax.axhline(1.0, color="gray", ls=":", lw=1, label="ideal: flat (1)")
    ax.axhline(FLAT_LIMIT, color="gray", ls="-", lw=0.5, alpha=0.5)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    for axis in (ax.xaxis, ax.yaxis):
      axis.set_major_formatter(ticker.FormatStrFormatter("%g"))
    ax.set_xlabel("N new tokens in one forward")
    ax.set_ylabel("T(N) / T(1)")
    ax.set_title(f"{model} {dtype}, depth {depth}, batch 1", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
  for ax in list(axes.flat)[len(groups):]:
    ax.axis("off")
  wd.save_figure(fig, path, dpi=110)


def plot_decode(path: str, records: Sequence[Record]) -> None:
  """T(1) (batch 1) per backend, grouped by model/dtype/depth."""
  plt = wd.pyplot()
  groups = _groups(records)
  names = [b for b in BACKENDS if any(b in g for g in groups.values())]
  fig, ax = plt.subplots(figsize=(max(6.0, 2.2 * len(groups) + 2), 4.5))
  width = 0.8 / max(1, len(names))
  for i, name in enumerate(names):
    xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(groups))]
    ys = [1e3 * g[name][1] if name in g and 1 in g[name] else 0.0
          for g in groups.values()]
    bars = ax.bar(xs, ys, width, label=name)
    ax.bar_label(bars, fmt="%.1f", fontsize=6)
  ax.set_xticks(range(len(groups)))
  ax.set_xticklabels([f"{m}\n{d}, depth {c}" for m, d, c in groups], fontsize=8)
  ax.set_ylabel("T(1) ms (one decode step, batch 1)")
  ax.set_title("Decode step time per backend (lower is better)")
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3, axis="y")
  wd.save_figure(fig, path, dpi=110)


def _fmt(x, spec=".2f") -> str:
  return "-" if x is None else format(x, spec)


def _scaling_table(curves: dict[str, dict[int, float]], c, cost: Record,
                   util: dict[str, float], threads: dict[str, int]
                   ) -> tuple[str, list[str]]:
  """The per-group table and its sentences (flat region, cliffs). A T(1)
  measured while the process got under 80% of its threads' CPU time is
  marked: a backend starved by other work inflates T(1) and deflates every
  ratio (XLA:CPU may also simply not use its whole pool)."""
  ns = [n for n in SUMMARY_NS if any(n in cv for cv in curves.values())]
  t_d = cost.get("t_draft_s")
  rows, lines = [], []
  for name in [b for b in BACKENDS if b in curves]:
    cv = curves[name]
    if 1 not in cv:
      continue
    c_ratio = c.c or (t_d / curves["xla"][1] if t_d and "xla" in curves else None)
    leave, cliffs = scaling_report(cv)
    sp = allowed_speedup(cv, c.alpha, c.gamma, c_ratio) if c_ratio else None
    cpu = util.get(name)
    low = cpu is not None and cpu < 0.8 * min(threads.get(name, 1), os.cpu_count() or 1)
    rows.append([name, f"{1e3 * cv[1]:.2f}", f"{1 / cv[1]:.1f}",
                 _fmt(cpu) + (" (<0.8×threads)" if low else "")]
                + [_fmt(cv[n] / cv[1]) if n in cv else "-" for n in ns]
                + [str(leave) if leave else f"> {max(cv)}",
                   ", ".join(f"{a}→{b} ×{s:.2f}" for a, b, s in cliffs) or "none",
                   _fmt(sp, ".2f")])
    lines.append(f"- {name}: " + (f"leaves the flat region at N = {leave} "
                 f"(T({leave})/T(1) = {cv[leave] / cv[1]:.2f})" if leave else
                 f"stays flat up to N = {max(cv)}") + "; " +
                 ("cliffs at " + ", ".join(f"N {a}→{b} (×{s:.2f})" for a, b, s in cliffs)
                  if cliffs else "no cliff") + ".")
  cols = (["backend", "T(1) ms", "t/s", "CPU cores"] + [f"T({n})/T(1)" for n in ns]
          + ["leaves flat at N", "cliffs", f"speedup α{c.alpha:g} γ{c.gamma}"])
  table = tables.markdown_table(cols, rows, [False] + [True] * (len(cols) - 4) + [True, False, True])
  return table, lines


@dataclasses.dataclass(frozen=True)
class Outcome:
  """What a batch-scaling run produced, as its report reads it (records and
  notes, not the runner's state)."""
  c: Any                      # the run's config (configs/batch_scaling.py)
  env: Record                 # batch_scaling's environment record
  records: Sequence[Record]   # one per (model, dtype, depth, backend, B, N)
  notes: Mapping[str, str]    # per backend: why it was skipped or how it ran
  parity: Sequence[Record]    # the parity checks before any timing
  costs: Sequence[Record]     # the draft's T(1) per (model, dtype, depth)


def summary_markdown(run: Outcome) -> str:
  c, env, records = run.c, run.env, run.records
  speedup_c = (f"{c.c:g} (configured)" if c.c else
               f"T_draft(1)/T_target(1), {c.draft} over the target, both on xla")
  out = ["# Batch scaling: XLA vs PyTorch vs llama.cpp", "",
         f"Machine: {wd.machine_line(env)}.", "",
         f"Host {env['host']}; threads: XLA {env['xla_threads']} (its Eigen pool), "
         f"torch and llama.cpp {env['threads']}. Load average (1, 5, 15 min) at start "
         f"{_fmt_load(env.get('load_avg_start'))}, at end "
         f"{_fmt_load(env.get('load_avg_end'))}. torch {env['torch']}, "
         f"transformers {env['transformers']}, llama-cpp-python {env['llama_cpp']}, "
         f"gguf {env['gguf']}.", "",
         f"T(N): median of {c.reps * c.rounds} repetitions ({c.rounds} round(s), "
         f"backends alternating) of one forward over N new tokens per row, all logits "
         f"computed, against a cache already holding `depth` tokens per row (rolled "
         f"back between calls). `xla` is one host-dispatched call per forward, like "
         f"torch and llama.cpp; `xla-loop` "
         f"runs {c.loop_k} forwards in one jitted loop (no dispatch) and reports the "
         f"time per forward. XLA attends over whole blocks of the model's attn_block "
         f"slots up to the used length (over the whole capacity, depth + max N rounded "
         f"up to {kvc.CAPACITY_ROUND}, when it is one block or less); torch-compile over "
         f"the whole capacity; torch eager and llama.cpp over the depth + N filled slots. `CPU cores`: process CPU seconds per wall "
         f"second during the timed calls at N = 1 (spinning threads count). The flat "
         f"region ends at the smallest N with T(N)/T(1) > {FLAT_LIMIT}; a cliff is a "
         f"step between measured N with T(N)/T(N_prev) > max({CLIFF_STEP}, N/N_prev) "
         f"(worse than linear). Speedup: what each backend's curve allows at "
         f"α {c.alpha:g}, γ {c.gamma} (theory.speedup_from_curve), with c = "
         f"{speedup_c}.", ""]
  out += _busy_warning(env, records)
  out += ["## Backends", ""]
  for name in c.backends:
    out.append(f"- {name}: {run.notes.get(name, 'measured')}")
  if "threads" in run.notes:
    out.append(f"- threads: {run.notes['threads']}")
  out += ["", "## Parity (max |Δlogit| / max |logit| against xla, before any timing)", ""]
  out.append(tables.markdown_table(
      ("model", "dtype", "depth", "B", "N", "backend", "error", "tolerance", "call s"),
      [(p["model"], p["dtype"], str(p["depth"]), str(p["batch"]), str(p["n_tokens"]),
        p["backend"], f"{p['parity_error']:.2e}", f"{p['tolerance']:g}",
        f"{p['call_s']:.2f}") for p in run.parity],
      (False, False, True, True, True, False, True, True, True)))
  out.append("\n`call s`: wall time of the parity call, which is each backend's "
             "first call at that shape (torch.compile compiles there).")
  costs = {(r["model"], r["dtype"], r["depth"]): r for r in run.costs}
  for (model, dtype, depth), curves in _groups(records).items():
    cost = costs.get((model, dtype, depth), {})
    t1 = [r for r in records if r["batch"] == 1 and r["n_tokens"] == 1
          and (r["model"], r["dtype"], r["depth"]) == (model, dtype, depth)]
    table, lines = _scaling_table(curves, c, cost,
                                  {r["backend"]: r["cpu_util"] for r in t1},
                                  {r["backend"]: r["threads"] for r in t1})
    cap = cost.get("capacity", "?")
    c_txt = (f"c = {c.c:g}" if c.c else
             f"c = {cost['t_draft_s'] / curves['xla'][1]:.3f}" if cost.get("t_draft_s")
             and "xla" in curves else "c not measured")
    out += ["", f"## {model} {dtype}, depth {depth} (batch 1, cache capacity {cap}, {c_txt})",
            "", table, "", *lines]
  out += _batched_section(records) + _compile_section(records)
  return "\n".join(out) + "\n"


BUSY_LOAD = 0.5  # load average per core above which the summary warns


def _busy_warning(env: Record, records: Sequence[Record]) -> list[str]:
  """A warning when the machine was busy: timings then depend on what else
  ran. Fork-join thread pools (torch's and llama.cpp's OpenMP) wait at every
  op for a thread the scheduler may have parked, and slow down many-fold."""
  load = max((env.get(k) or [0.0])[0] for k in ("load_avg_start", "load_avg_end"))
  if load <= BUSY_LOAD * (env["cpu_count"] or 1):
    return []
  starved = [r for r in records if r["cpu_util"] < 0.8 * min(r["threads"], env["cpu_count"] or 1)]
  text = (f"**Warning: the machine was busy** (load average up to {load:.2f} on "
          f"{env['cpu_count']} cores): other work shares the cores, and "
          f"{len(starved)} of {len(records)} points got less than 80% of their "
          f"threads' CPU time (`cpu_util` in results.csv; `CPU cores` below).")
  if env["threads"] > 1:
    text += (f" With {env['threads']} threads, OpenMP backends (torch, llama.cpp) "
             f"lose a scheduler slice at every barrier when a core is taken, and can "
             f"run 10-50x slower than on an idle machine; on a shared machine compare "
             f"single-threaded: `XLA_FLAGS=--xla_cpu_multi_thread_eigen=false` and "
             f"`--config.threads=1`.")
  return [text, ""]


def _fmt_load(x) -> str:
  return "-" if not x else ", ".join(f"{v:.2f}" for v in x)


def _batched_section(records: Sequence[Record]) -> list[str]:
  rs = [r for r in records if r["batch"] > 1]
  if not rs:
    return []
  base = {(r["model"], r["dtype"], r["depth"], r["backend"], r["n_tokens"]): r["median_s"]
          for r in records if r["batch"] == 1}
  rows = []
  for r in sorted(rs, key=lambda r: (r["model"], r["dtype"], r["depth"],
                                     BACKENDS.index(r["backend"]), r["n_tokens"], r["batch"])):
    t_b1 = base.get((r["model"], r["dtype"], r["depth"], r["backend"], r["n_tokens"]))
    rows.append([r["model"], r["dtype"], str(r["depth"]), r["backend"], str(r["n_tokens"]),
                 str(r["batch"]), f"{1e3 * r['median_s']:.2f}", f"{r['tps']:.1f}",
                 _fmt(r["median_s"] / t_b1 if t_b1 else None)])
  return ["", "## Batched view (B rows of N new tokens each)", "",
          tables.markdown_table(("model", "dtype", "depth", "backend", "N", "B", "T ms",
                                "t/s (B N / T)", "T / T(B=1)"), rows,
                               (False, False, True, False, True, True, True, True, True))]


def _compile_section(records: Sequence[Record]) -> list[str]:
  acc: dict[tuple, list[float]] = {}
  for r in records:
    a = acc.setdefault((r["model"], r["dtype"], r["backend"]), [0.0, 0.0])
    a[0] += r["compile_s"]
    if r["first_call_s"] is not None:
      a[1] += max(0.0, r["first_call_s"] - r["median_s"])
  rows = [[m, d, b, f"{x[0]:.1f}", f"{x[1]:.1f}"] for (m, d, b), x in acc.items()]
  return ["", "## Compile and first-call time (excluded from every timing)", "",
          "compile s: JAX compile events (XLA only). first-call s: warm-up call minus "
          "the median, summed over points (torch.compile's compile, llama.cpp's and "
          "torch's first-call costs; for xla it repeats the compile).", "",
          tables.markdown_table(("model", "dtype", "backend", "compile s", "first-call s"),
                               rows, (False, False, False, True, True))]


def write_outputs(w: str, run: Outcome) -> str:
  """results.csv, scaling.png, decode.png, summary.md, parity.json in the
  workdir w; returns the summary."""
  wd.write_csv(os.path.join(w, wd.CSV_FILE), run.records, CSV_COLUMNS, csv_row)
  if run.records:
    plot_scaling(os.path.join(w, "scaling.png"), run.records)
    plot_decode(os.path.join(w, "decode.png"), run.records)
  md = summary_markdown(run)
  with open(os.path.join(w, wd.SUMMARY), "w") as f:
    f.write(md)
  wd.write_json(os.path.join(w, "parity.json"), run.parity)
  return md
