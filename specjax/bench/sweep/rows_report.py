"""Per-row lengths in the reports (rows.py's records): per (drafter, batch,
rule, temperature), each per-row point beside the best fixed gamma and auto
of the same setting, with the per-row theory: tokens per loop step measured
and as the geometric model has them (the allocator's prediction, the oracle
bound, the uniform split of the same budget), and, at a fixed budget, the
measured-cost prediction. The gamma sweep's batch section and the task
suite's mixed batches (taskbench_report.py) print the same table."""

from __future__ import annotations

from specjax.bench.sweep import engine

HEAD = ["drafter", "B", "rule", "T", "target-only t/s", "per-row", "speedup", "predicted",
        "tokens/step: measured", "allocator", "oracle", "uniform", "best fixed (gamma)",
        "auto", "per-row / best fixed", "per-row / auto", "budgets used"]


def is_rows(r) -> bool:
  """A per-row lengths' record (gamma auto:rows,..)."""
  return isinstance(r.get("gamma"), str) and engine.parse_rows(r["gamma"]) is not None


def label(spec: str) -> str:
  """'per-row, budget N' / 'per-row, budget auto' / 'per-row, default budget'."""
  _, budget = engine.parse_rows(spec)
  return f"per-row, budget {budget}" if budget else "per-row, default budget"


def _setting(r) -> tuple:
  return (str(r.get("drafter") or "model"), int(r.get("batch", 1)), r["accept_rule"],
          float(r["temperature"]))


def _f(v, spec=".3f") -> str:
  return "-" if v is None else format(v, spec)


def rows_lines(records) -> list[str]:
  """The table (module docstring): one line per per-row point."""
  rows = [r for r in records if is_rows(r)]
  out = ["| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
  for r in sorted(rows, key=lambda r: (_setting(r), str(r["gamma"]))):
    same = [x for x in records if _setting(x) == _setting(r) and not is_rows(x)]
    fixed = [x for x in same if x["gamma"] != "auto"]
    auto = next((x for x in same if x["gamma"] == "auto"), None)
    best = max(fixed, key=lambda x: x["speedup"], default=None)
    th = r.get("rows_theory") or {}
    used = " ".join(f"{n}:{k}" for n, k in (r.get("budgets_used") or {}).items() if k)
    out.append("| " + " | ".join([
        _setting(r)[0], str(r["batch"]), r["accept_rule"], f"{r['temperature']:g}",
        f"{r['baseline_tps']:.1f}", f"{label(r['gamma'])} (N {_f(th.get('budget'), '.1f')})",
        f"{r['speedup']:.3f}", _f(r.get("predicted_measured_cost")),
        _f(th.get("measured"), ".2f"), _f(th.get("predicted"), ".2f"),
        _f(th.get("oracle"), ".2f"), _f(th.get("uniform"), ".2f"),
        "-" if best is None else f"{best['speedup']:.3f} ({best['gamma']})",
        "-" if auto is None else f"{auto['speedup']:.3f}",
        "-" if best is None else f"{r['speedup'] / best['speedup']:.3f}",
        "-" if auto is None else f"{r['speedup'] / auto['speedup']:.3f}", used or "-"]) + " |")
  return out


def rows_markdown(records) -> list[str]:
  """The gamma sweep's per-row section (nothing when no per-row point ran)."""
  if not any(is_rows(r) for r in records):
    return []
  return ["", "### Per-row lengths against the best fixed gamma and auto", "",
          "Each row of the batch its own draft length (--gamma=auto:rows: the top N - B gains "
          "alpha_b^k of a verify budget of N tokens, one packed verify). predicted: the "
          "measured-cost model (a fixed budget: G T_draft(1) + T_packed(B, N) + T_accept; "
          "budget=auto: each loop step at its budget's calibrated T(N)); "
          "tokens per loop step (all rows) measured beside the geometric model's: the "
          "allocator's (its running alphas and the lengths it gave), the oracle (each row's "
          "fitted alpha known, the best lengths within the same budget) and the uniform split "
          "of the same budget. Speedups over target-only at the same batch.", "",
          *rows_lines(records), ""]
