"""The published speculative-decoding numbers, from specjax.metrics alone.

No model, no accelerator: every number comes from the closed forms in
specjax/metrics/theory.py and, for the llama.cpp thread's own
approximations, specjax/metrics/llamacpp_thread.py. `write_outputs` writes
speedup_vs_gamma.png (Theorem 3.8 per c and alpha), optimal_gamma_vs_alpha.png
(the paper's Figure 3), summary.md (Table 1 beside the paper, the alpha x gamma
speedups at c = 0, the optimal gamma per (alpha, c), the #3649 worked
examples beside the thread's numbers), the grid as results.csv and
results.jsonl, and config.json. experiments/reproduce_paper.py is the
script; docs/sweep.md the results.
"""

from __future__ import annotations

import os
import platform

import matplotlib
import matplotlib.ticker
import numpy as np

from specjax.metrics import llamacpp_thread
from specjax.metrics import theory
from specjax import workdir as wd
from specjax.errors import SpecjaxError

plt = wd.pyplot()

ALPHAS = (0.5, 0.6, 0.7, 0.8, 0.9)
PLOT_CS = (0.0, 0.05, 0.1, 0.2)  # one panel each
FIG3_CS = (0.01, 0.02, 0.05, 0.1, 0.2)  # lines of the optimal-gamma figure
FIG3_MAX_GAMMA = 64

# Leviathan et al. 2023, Table 1 (c = c_hat = 0): alpha, gamma, operations, speed.
PAPER_TABLE_1 = ((0.6, 2, 1.53, 1.96), (0.7, 3, 1.58, 2.53), (0.8, 2, 1.23, 2.44),
                 (0.8, 5, 1.63, 3.69), (0.9, 2, 1.11, 2.71), (0.9, 10, 1.60, 6.86))


def grid_rows(max_gamma: int) -> list[dict]:
  """Theorem 3.8 and 3.11 on the (alpha, c, gamma) grid of the plot."""
  rows = []
  for c in PLOT_CS:
    for alpha in ALPHAS:
      for gamma in range(1, max_gamma + 1):
        rows.append({
            "alpha": alpha, "c": c, "gamma": gamma,
            "tokens_per_step": theory.expected_tokens_per_step(alpha, gamma),
            "speedup": theory.leviathan_speedup(alpha, gamma, c),
            "operations_factor": theory.operations_factor(alpha, gamma, c),
        })
  return rows


def plot_speedup_vs_gamma(max_gamma: int, path: str) -> None:
  gammas = np.arange(1, max_gamma + 1)
  fig, axes = plt.subplots(2, 2, figsize=(10, 7.5), sharex=True)
  for ax, c in zip(axes.flat, PLOT_CS):
    for alpha in ALPHAS:
      speed = theory.leviathan_speedup(alpha, gammas, c)
      best = int(np.argmax(speed))
      (line,) = ax.plot(gammas, speed, marker="o", ms=3, label=f"α = {alpha}")
      ax.plot(gammas[best], speed[best], "*", ms=12, color=line.get_color())
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_title(f"c = T_draft / T_target = {c}")
    ax.set_ylabel("walltime improvement (×)")
    ax.grid(alpha=0.3)
  for ax in axes[1]:
    ax.set_xlabel("γ (drafted tokens per step)")
  axes[0, 0].legend(loc="upper left", fontsize=9)
  fig.suptitle("Leviathan et al. 2023, Theorem 3.8: speedup vs γ (★ = best γ ≤ "
               f"{max_gamma})")
  wd.save_figure(fig, path)


def plot_optimal_gamma(path: str) -> None:
  alphas = np.linspace(0.05, 0.95, 91)
  fig, ax = plt.subplots(figsize=(6.5, 4.5))
  for c in FIG3_CS:
    best = theory.optimal_gamma(alphas, c, max_gamma=FIG3_MAX_GAMMA)
    useful = theory.speedup_possible(alphas, c)  # Corollary 3.9: else no γ helps
    ax.step(alphas[useful], best[useful], where="mid", label=f"c = {c}")
  ax.set_xlabel("α (per-token acceptance)")
  ax.set_ylabel("optimal γ")
  ax.set_yscale("log", base=2)
  ax.yaxis.set_major_formatter(matplotlib.ticker.StrMethodFormatter("{x:.0f}"))
  ax.set_title("Optimal γ vs α (cf. Leviathan et al. 2023, Figure 3)")
  ax.grid(alpha=0.3, which="both")
  ax.legend()
  wd.save_figure(fig, path)


def table_1_md() -> list[str]:
  lines = ["## Leviathan et al. 2023, Table 1 (c = ĉ = 0)", "",
           "| α | γ | operations (paper) | operations (theory.py) | speed (paper) | speed (theory.py) |",
           "|---|---|---|---|---|---|"]
  for alpha, gamma, ops, speed in PAPER_TABLE_1:
    ours_ops = theory.operations_factor(alpha, gamma, 0.0)
    ours_speed = theory.leviathan_speedup(alpha, gamma, 0.0)
    lines.append(f"| {alpha} | {gamma} | {ops:.2f}× | {ours_ops:.4f}× | {speed:.2f}× | {ours_speed:.4f}× |")
  return lines


def speedup_grid_md(max_gamma: int) -> list[str]:
  gammas = range(1, max_gamma + 1)
  lines = ["## Theorem 3.8 speedup (×) at c = 0, α × γ", "",
           "| α \\ γ | " + " | ".join(str(g) for g in gammas) + " |",
           "|---|" + "---|" * len(gammas)]
  for alpha in ALPHAS:
    cells = " | ".join(f"{theory.leviathan_speedup(alpha, g, 0.0):.2f}" for g in gammas)
    lines.append(f"| {alpha} | {cells} |")
  return lines


def optimal_gamma_md(max_gamma: int) -> list[str]:
  lines = [f"## Optimal γ ≤ {max_gamma} and its speedup (Section 3.5; Corollary 3.9 bound)", "",
           "| α | c | optimal γ | speedup (×) | (1+α)/(1+c) | α > c |", "|---|---|---|---|---|---|"]
  for c in PLOT_CS:
    for alpha in ALPHAS:
      gamma = theory.optimal_gamma(alpha, c, max_gamma=max_gamma)
      speed = theory.leviathan_speedup(alpha, gamma, c)
      bound = theory.min_speedup_gamma1(alpha, c)
      lines.append(f"| {alpha} | {c} | {gamma} | {speed:.3f} | {bound:.3f} | "
                   f"{'yes' if theory.speedup_possible(alpha, c) else 'no'} |")
  lines += ["", "At c = 0 the speedup grows with γ for every α < 1, so the optimum is the cap."]
  return lines


def thread_examples_md() -> list[str]:
  e_x = theory.expected_accepted(8, 0.95)
  rows = [
      ("Corrected Theorem 3.8 plug-in (α 0.44, γ 5, c 0.11)", "1.14×",
       f"{theory.leviathan_speedup(0.44, 5, 0.11):.4f}×", "0.66× (50/76 t/s, A100)"),
      ("V100 case 0 (α 0.8, γ 5; tg 619.4 / 52.5, pp5 121.7 t/s)", "2.1594861448542773",
       repr(llamacpp_thread.thread_approx_speedup(0.8, 5, 619.4, 52.5, 121.7)), "1.676× (87.954/52.49)"),
      ("V100 case 1 (α 0.875, γ 8; tg 625 / 52.5, pp8 194.6 t/s)", "2.7629832057356403",
       repr(llamacpp_thread.thread_approx_speedup(0.875, 8, 625.0, 52.5, 194.6)), "2.351× (123.394/52.49)"),
      ("E[X] accepted per step, N 8, p 0.95", "6.4 (79.94 %)",
       f"{round(e_x, 2)} ({round(100 * e_x / 8, 2)} %)", "-"),
      ("70B/7B speed: 503 tokens, 119 at 14.68 + 426 at ~19.86 t/s", "~17.02 t/s",
       f"{llamacpp_thread.mixed_speed(503, [(119, 14.68), (426, 19.86)]):.2f} t/s", "16.52 t/s"),
      ("  same, 19.86 rebuilt as 1/(1/90.20 + 1/25.48) t/s", "~19.86 t/s",
       f"{llamacpp_thread.serial_speed(90.20, 25.48):.2f} t/s → "
       f"{llamacpp_thread.thread_expected_speed(503, 384, 426, 14.68, 90.20, 25.48):.2f} t/s", "16.52 t/s"),
  ]
  lines = ["## llama.cpp issue #3649 worked examples", "",
           "| example | thread | theory.py | measured in thread |", "|---|---|---|---|"]
  lines += [f"| {name} | {printed} | {ours} | {measured} |" for name, printed, ours, measured in rows]
  lines += ["", "The V100 predictions use ggerganov's c = tg_target / mean(tg_draft, pp_target(γ)); "
            "the 70B/7B figure is his accounting, n_predict / (time of the non-draft tokens at tg "
            "+ time of the drafted tokens at draft-then-verify speed)."]
  return lines


def summary_md(max_gamma: int) -> str:
  sections = [["# Speculative decoding theory: published numbers reproduced", "",
               "Source: specjax/theory.py only (no model runs). Speedups are expected walltime "
               "improvement factors over target-only decoding."],
              table_1_md(), speedup_grid_md(max_gamma), optimal_gamma_md(max_gamma),
              thread_examples_md(),
              ["## Figures", "", "- `speedup_vs_gamma.png`", "- `optimal_gamma_vs_alpha.png`"]]
  return "\n\n".join("\n".join(s) for s in sections) + "\n"


def write_outputs(workdir: str, max_gamma: int) -> str:
  """Every output into `workdir` (specjax.workdir's conventions); returns
  the summary."""
  if not 1 <= max_gamma <= 64:
    raise SpecjaxError(f"max_gamma must be an integer in [1, 64], got {max_gamma}")
  rows = grid_rows(max_gamma)
  wd.restart_jsonl(os.path.join(workdir, wd.RESULTS), rows)
  wd.write_csv(os.path.join(workdir, wd.CSV_FILE), rows, list(rows[0]))
  wd.write_config(workdir, {"max_gamma": max_gamma, "alphas": ALPHAS, "cs": PLOT_CS,
                            "fig3_cs": FIG3_CS},
                  {"python": platform.python_version(), "numpy": np.__version__,
                   "matplotlib": matplotlib.__version__})
  plot_speedup_vs_gamma(max_gamma, os.path.join(workdir, "speedup_vs_gamma.png"))
  plot_optimal_gamma(os.path.join(workdir, "optimal_gamma_vs_alpha.png"))
  summary = summary_md(max_gamma)
  with open(os.path.join(workdir, wd.SUMMARY), "w") as f:
    f.write(summary)
  return summary
