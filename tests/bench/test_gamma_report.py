"""The gamma sweep's drafter report (bench/sweep/gamma_report.py) on a sweep
without a batch-1 point: it reads the smallest batch (it used to draw an
empty figure and fail in matplotlib)."""

from specjax.bench.sweep import gamma_report


def _rec(drafter, gamma, batch, speedup):
  return {"drafter": drafter, "gamma": gamma, "batch": batch, "accept_rule": "real",
          "temperature": 0.0, "speedup": speedup, "predicted_measured_cost": speedup * 1.1}


def test_drafters_at_the_smallest_batch_are_plotted(tmp_path):
  records = [_rec(d, g, b, s) for d, s in (("ngram", 1.2), ("model", 0.9))
             for g in (2, 4) for b in (2, 4)]
  points = gamma_report._drafter_points(records)  # pylint: disable=protected-access
  assert {k[0] for k in points} == {"ngram", "model"}
  assert all(r["batch"] == 2 for rs in points.values() for r in rs)
  gamma_report.plot_drafters(str(tmp_path / "drafters.png"), records)
  assert (tmp_path / "drafters.png").stat().st_size > 0
  gamma_report.plot_drafters(str(tmp_path / "none.png"), [])  # nothing to draw: no file, no error
  assert not (tmp_path / "none.png").exists()
