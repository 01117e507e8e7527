"""contexts.png's numbers (bench/sweep/context_plot.py) on records and a fit
of known values: the best gamma's point at the lowest temperature, the
sweep's measured-cost prediction, the fit's speedup and KV share worked out
by hand, each line's crossover, PyTorch's panels from its fit alone; the
cost surface's shipped records give back its fits and predicted turn
(docs/long_context.md); committed deliberate bugs that must each fail."""

import json
import pathlib

import pytest

from specjax.bench.studies import cost_surface_report as csr
from specjax.bench.sweep import context_plot as cp
from specjax.metrics import context_cost as cc

SURFACE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "results" / "cost_surface"
SD = "streaming:8,2"
KAPPA = 4e-10
FIT = cp.SurfaceFit(
    models={"xla": {"target": cc.StepModel((1, 5), (0.05, 0.06), (0.01, 0.04), KAPPA),
                    SD: cc.StepModel((1,), (0.05,), (0.01,), KAPPA)},
            "torch": {"target": cc.StepModel((1, 5), (0.04, 0.08), (0.015, 0.03), 3e-10),
                      SD: cc.StepModel((1,), (0.05,), (0.02,), 3e-10)}},
    reads={"target": cc.Reads(1000.0), SD: cc.Reads(1000.0, window=10)})
MEASURED = {(SD, 4096): (1.0, 1.2, 1.3), (SD, 512): (0.9, 0.7, 0.8),
            ("ngram", 4096): (1.1, 0.9, 0.8)}


def record(d, c, b, speedup, gamma=4, temperature=0.0):
  rows = b if b > 1 else 3  # batch 1: each of the 3 prompts alone
  return dict(drafter=d, context=c, batch=b, gamma=gamma, temperature=temperature,
              speedup=speedup, predicted_measured_cost=speedup + 0.1, alpha=0.8,
              n_predict=64 * rows, n_prompts=3)


def records():
  out = []
  for (d, c), sp in MEASURED.items():
    for b, s in zip((1, 4, 8), sp):
      out += [record(d, c, b, s), record(d, c, b, s - 0.3, gamma=2),  # the worse gamma
              record(d, c, b, s + 1.0, temperature=1.0)]              # not the greedy point
  return out


def by_hand(engine, c, b):
  """The fit's speedup at (c, b), alpha 0.8, gamma 4, 63 tokens a row, and the
  KV share of the target's decode step."""
  m = FIT.models[engine]
  sp = cc.speedups(m["target"], m[SD], FIT.reads["target"], FIT.reads[SD], 0.8, 4, c, [b],
                   n_tokens=63)[0]
  kv = KAPPA * b * 1000.0 * (c + 1)
  return sp, kv / (0.05 + 0.01 * b + kv)


def check(panels):
  assert [(p.engine, p.drafter, p.predicted_only) for p in panels] == [
      ("xla", "ngram", False), ("xla", SD, False), ("torch", SD, True)]
  assert "predicted from its fit, not measured" in panels[2].title
  assert "predicted" not in panels[1].title
  ngram, (c512, c4k), (t512, t4k) = panels[0].curves[0], panels[1].curves, panels[2].curves
  assert c4k.batches == (1, 4, 8) and c4k.measured == MEASURED[(SD, 4096)]
  assert c4k.predicted_cost == pytest.approx([1.1, 1.3, 1.4])
  for i, b in enumerate(c4k.batches):
    sp, share = by_hand("xla", 4096, b)
    assert c4k.predicted_fit[i] == pytest.approx(sp, rel=1e-9)
    assert c4k.kv_share[i] == pytest.approx(share, rel=1e-9)
  assert ngram.predicted_fit is None and ngram.kv_share is not None  # no fit of n-gram's draft
  assert (c4k.turn, c512.turn, ngram.turn) == ("rises from B=1", "turns at B=4", "never rises")
  assert t4k.measured is None and t4k.predicted_cost is None
  assert t4k.predicted_fit[1] != pytest.approx(c4k.predicted_fit[1])  # torch's own fit
  assert t4k.turn == cp.turn_label((1, 4, 8), t4k.predicted_fit) != ""


def test_the_curves_are_the_records_and_the_fit_worked_out_by_hand(tmp_path):
  check(cp.curves(records(), FIT))
  bare = cp.curves(records())
  assert [p.engine for p in bare] == ["xla", "xla"]  # no fit: no torch panel, no fit lines
  assert all(c.predicted_fit is None and c.kv_share is None for p in bare for c in p.curves)
  cp.plot(records(), str(tmp_path / "c.png"), FIT)
  assert (tmp_path / "c.png").stat().st_size > 0


def test_a_measured_torch_run_gets_a_measured_panel_of_its_own():
  """Records that name the torch engine (long_batch_check.py --engine=torch)
  are drawn in PyTorch's panel, beside its fit; XLA's panels keep theirs."""
  speeds = tuple(s - 0.2 for s in MEASURED[(SD, 4096)])
  torch_recs = [dict(record(SD, 4096, b, s), engine="torch") for b, s in zip((1, 4, 8), speeds)]
  panels = cp.curves(records() + torch_recs, FIT)
  assert [(p.engine, p.drafter, p.predicted_only) for p in panels] == [
      ("xla", "ngram", False), ("xla", SD, False), ("torch", SD, False)]
  assert panels[1].curves[1].measured == MEASURED[(SD, 4096)]
  (t4k,) = panels[2].curves
  assert t4k.context == 4096 and t4k.measured == speeds
  for i, b in enumerate(t4k.batches):
    assert t4k.predicted_fit[i] == pytest.approx(by_hand("torch", 4096, b)[0], rel=1e-9)


def test_the_surface_records_give_back_its_fits_and_predicted_turn():
  recs = [json.loads(x) for x in (SURFACE / "results.jsonl").read_text().splitlines()]
  shipped = json.loads((SURFACE / "crossover.json").read_text())
  fit = csr.surface_fit(recs)
  for e, ms in shipped["fits"].items():
    for role, m in ms.items():
      assert vars(fit.models[e][role]) == pytest.approx(
          {k: tuple(v) if isinstance(v, list) else v for k, v in m.items()})
  row = next(r for r in shipped["crossovers"]["xla"]
             if (r["drafter"], r["context"], r["alpha"]) == ("streaming:256,4", 4096, 0.8))
  for b, want in zip(row["batches"], row["speedups"]):  # 128 tokens a row, as there
    r = dict(drafter="streaming:256,4", context=4096, batch=b, gamma=4, alpha=0.8,
             n_predict=129 * b, n_prompts=1)
    assert fit.speedup("xla", r) == pytest.approx(want, rel=1e-9)
  assert fit.kv_share("xla", 4096, 8) == pytest.approx(0.843, abs=1e-3)  # the page's 0.84


def _late(turning):
  def bad(batches, values):
    b = turning(batches, values)
    return None if b is None else batches[min(list(batches).index(b) + 1, len(batches) - 1)]
  return bad


BUGS = {  # name: (module, attribute, mutation)
    "tokens per row not divided by the batch": (
        cp, "tokens_per_row", lambda f: lambda r: r["n_predict"] - 1),
    "the KV share of the verify, not the decode step": (
        cp.SurfaceFit, "kv_share", lambda f: lambda self, e, c, b: float(
            self.models[e]["target"].kv_share(b, 5, self.reads["target"].bytes(b, c, 5)))),
    "the turn one batch late": (cc, "turning_batch", _late),
    "the last gamma's point, not the best": (
        cp, "chosen", lambda f: lambda recs: {
            (cp.engine_of(r), r["drafter"], r["context"], r["batch"]): r
            for r in recs if r["temperature"] == 0}),
    "the measured engine's fit drawn for every engine": (
        cp.SurfaceFit, "speedup", lambda f: lambda self, e, r: f(self, "xla", r)),
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_each_deliberate_bug_fails(monkeypatch, bug):
  owner, name, make = BUGS[bug]
  monkeypatch.setattr(owner, name, make(getattr(owner, name)))
  with pytest.raises(AssertionError):
    check(cp.curves(records(), FIT))
