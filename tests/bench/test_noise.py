"""noise.py on hand-made records: what should not move between points (the
target-only speed and T(1) of one workload) flags the run and the points
that moved, with one line naming the likely cause; workloads that differ
(another batch, another temperature) are never compared. MUTATIONS are
deliberate bugs, each failing a check."""

import pytest

import lawcheck
from specjax.bench.sweep import noise

T = 0.15


def rec(gamma, tps, t1=0.010, batch=1, temp=0.0, load=0.5, reps=None):
  return {"gamma": gamma, "drafter": "model", "accept_rule": "real", "batch": batch,
          "temperature": temp, "top_k": 0, "top_p": 1.0, "baseline_tps": tps,
          "t_target_s": t1, "baseline_tps_reps": reps or [tps],
          "env": {"load_avg": [load, load, load], "cpu_count": 2}}


# The issue's run: the target-only speed moved from 4.9 to 30 tokens/s between points.
ISSUE = [rec(1, 30.0), rec(2, 29.0), rec(3, 4.9, load=3.2), rec(4, 29.5)]
# A quiet batch sweep: B = 4 runs 3.8x the tokens/s of B = 1, T = 1 is slower; each
# workload within 5 %.
QUIET = ([rec(g, 30.0 + g / 4) for g in (1, 2, 3)] + [rec(g, 114.0 - g, batch=4) for g in (1, 2)]
         + [rec(g, 20.0, t1=0.012, temp=1.0) for g in (1, 2)])


def check(assess) -> list[str]:
  """The names of the checks that fail for this `assess`."""
  bad = []
  quiet = assess(QUIET, T)
  if quiet["noisy"] or quiet["points"] or len(quiet["workloads"]) != 3:
    bad.append(f"a quiet sweep flagged: {quiet['points']}")
  found = assess(ISSUE, T)
  names = [p["point"] for p in found["points"]]
  if not found["noisy"] or names != ["model B=1 gamma 3 real T=0"]:
    bad.append(f"the issue's run: {names}")
  if "load changed" not in (found["cause"] or ""):
    bad.append(f"cause {found['cause']!r}")
  w = found["workloads"][0]["baseline_tps"] if found["workloads"] else {}
  if abs(w.get("spread", 0) - (30.0 - 4.9) / 29.25) > 1e-9:
    bad.append(f"spread {w}")
  # T(1) moves alone; a point whose repetitions disagree
  t1 = assess([rec(1, 30.0), rec(2, 30.0, t1=0.02), rec(3, 30.0)], T)
  if [p["point"] for p in t1["points"]] != ["model B=1 gamma 2 real T=0"]:
    bad.append(f"T(1) outlier: {t1['points']}")
  reps = assess([rec(1, 30.0, reps=[30.0, 20.0, 31.0])], T)
  if not reps["noisy"]:
    bad.append("repetitions that disagree: not flagged")
  # just under the threshold: not noisy; a spread is (max - min) / median
  edge = assess([rec(1, 30.0), rec(2, 30.0 * (1 + 0.9 * T)), rec(3, 30.0)], T)
  if edge["noisy"]:
    bad.append(f"a spread of {0.9 * T:.3f} flagged")
  return bad


def test_noise_flags_what_moved_and_only_that():
  assert check(noise.assess) == []
  text = "\n".join(noise.section(noise.assess(ISSUE, T)))
  assert "NOISY RUN: likely cause: the machine's load changed" in text
  assert "- model B=1 gamma 3 real T=0: target-only speed 4.9 tokens/s" in text
  assert "| 1 | 0 | 4 | 4.9 / 29.2 / 30.0 | 86 % |" in text
  quiet = noise.with_section("# Sweep\n\nbody\n", noise.assess(QUIET, T))
  assert quiet.startswith("# Sweep\n\nbody\n") and "the machine held still" in quiet
  noisy = noise.with_section("# Sweep\n\nbody\n", noise.assess(ISSUE, T)).splitlines()
  assert noisy[0] == "# Sweep" and noisy[2].startswith("**Noisy run**")


def test_causes():
  drift = [rec(g, 30.0 - 5 * g) for g in range(4)]
  assert "steady drift" in noise.assess(drift, T)["cause"]
  busy = [rec(1, 30.0, load=4.0), rec(2, 20.0, load=4.2), rec(3, 30.0, load=4.1)]
  assert "competed for the cores" in noise.assess(busy, T)["cause"]
  bursts = [rec(1, 30.0), rec(2, 20.0), rec(3, 30.0)]
  assert "bursts" in noise.assess(bursts, T)["cause"]


MUTATIONS = {
    "every point compared, whatever its batch and temperature": (
        "assess", "groups.setdefault(workload(r), []).append(r)",
        "groups.setdefault((1, 0.0, 0, 1.0), []).append(r)"),
    "the spread taken against the fastest point, not the median": (
        "spread", "/ statistics.median(xs)", "/ max(xs)"),
    "a point flagged at any distance from the median": (
        "assess", "abs(r[field] / med - 1) > threshold / 2", "abs(r[field] / med - 1) >= 0"),
    "repetitions ignored": ("assess", "if spread(reps) > threshold:", "if False:"),
}


@pytest.mark.parametrize("bug", list(MUTATIONS))
def test_each_deliberate_bug_fails(bug, monkeypatch):
  name, old, new = MUTATIONS[bug]
  monkeypatch.setattr(noise, name, lawcheck.mutant(getattr(noise, name), old, new))
  bad = check(noise.assess)
  print(f"MUTATION | {bug} | {bad[:2]}")
  assert bad, f"{bug}: not caught"
