"""The sweep's cost model by hand: synthetic costs and statistics in, the
predictions and efficiency out; and the probes on a tiny model."""

import jax
import numpy as np
import pytest

from specjax.model import config
from specjax.bench.sweep import costs
from specjax.decode import plan
from specjax.decode import probes
from specjax.model import llama as model
from specjax.metrics import stats
from specjax.model import steps
from specjax.metrics import theory
from specjax.model.sampling import SamplingParams

MS = 1e-3
# T_target(1), T_target(gamma), T_target(gamma+1), T_draft(1), T_accept: all distinct,
# so that a prediction using the wrong one (T(gamma) for T(gamma+1)) differs.
STEP = costs.StepCosts(t_target=10 * MS, t_target_gamma=13 * MS, t_verify=15 * MS,
                       t_draft=2 * MS, t_accept=0.5 * MS)


def _records():
  """Four steps of gamma 3 for one row, n_predict 12 (the first token comes
  from the prompt): a full step, a partial one (which first fed the draft
  d_3: a catch-up), a full one, and a rejection at the first draft (another
  catch-up), cut to the one token that n_predict leaves."""
  return stats.Records(
      n_acc=np.array([3, 1, 3, 0]), n_drafted=np.array([3, 3, 3, 3]),
      kept=np.array([4, 2, 4, 1]), caught_up=np.array([0, 1, 0, 1]),
      step=np.arange(4), row=np.zeros(4, int))


def test_statistics_of_the_hand_example():
  st = stats.SpecStats.compute(_records(), gamma=3, n_predict=12, eval_s=0.09)
  assert (st.n_steps, st.n_accept, st.n_kept, st.n_catchup) == (4, 7, 11, 2)
  assert st.tokens_per_step == 11 / 4 and st.catchup_share == 0.5
  assert st.mean_accepted == 7 / 4 and st.accept_rate == 7 / 12
  assert st.tokens_per_s == pytest.approx(11 / 0.09)
  assert st.accept_hist == [1, 1, 0, 2]


def test_measured_cost_prediction_by_hand():
  st = stats.SpecStats.compute(_records(), gamma=3, n_predict=12)
  pred = costs.predict(st, STEP)
  # A step: 3 draft steps, half a catch-up step, the verify, the accept.
  step_ms = 3 * 2 + 0.5 * 2 + 15 + 0.5
  assert step_ms == 22.5
  assert pred["predicted_step_s"] == pytest.approx(22.5 * MS)
  # 2.75 tokens per step, each worth one 10 ms target-only step.
  assert pred["predicted_measured_cost"] == pytest.approx(2.75 * 10 / 22.5)
  # The same figure as the timeline of an engine that pays exactly these
  # costs: 4 steps (12 draft steps, 2 catch-ups, 4 verifies, 4 accepts) for
  # the 11 tokens after the first, against 11 target-only steps.
  timeline_ms = 12 * 2 + 2 * 2 + 4 * 15 + 4 * 0.5
  assert pred["predicted_measured_cost"] == pytest.approx((11 * 10) / timeline_ms)
  # What a wrong model would give, and does not.
  wrong_verify = 2.75 * 10 / (3 * 2 + 0.5 * 2 + 13 + 0.5)   # T(gamma) for T(gamma+1)
  no_catchup = 2.75 * 10 / (3 * 2 + 15 + 0.5)
  no_accept = 2.75 * 10 / (3 * 2 + 0.5 * 2 + 15)
  for wrong in (wrong_verify, no_catchup, no_accept):
    assert abs(pred["predicted_measured_cost"] - wrong) > 0.02
  # Leviathan at the i.i.d. alpha and c = 0.2; the thread's c from speeds.
  assert pred["predicted_leviathan"] == pytest.approx(
      theory.leviathan_speedup(st.alpha, 3, 0.2))
  c_thread = (1 / 10) / ((1 / 2 + 3 / 13) / 2)
  assert pred["predicted_thread"] == pytest.approx(theory.leviathan_speedup(st.alpha, 3, c_thread))
  # Efficiency is measured over predicted.
  assert STEP.c == pytest.approx(0.2) and STEP.verify_ratio == pytest.approx(1.5)


@pytest.fixture(scope="module")
def tiny():
  cfg = config.get_preset("tiny").replace(name="tiny-costs")
  return steps.Runner(cfg, model.init_params(cfg, seed=5))


@pytest.mark.parametrize("sp", [SamplingParams(), SamplingParams(0.8, top_k=5, top_p=0.9)])
def test_probes_measure_what_runs_do(tiny, sp):
  """T(n) for several n, with the sampling the runs do, and no compile in
  the timed repetitions (timing.measure raises on one)."""
  probe = probes.CostProbe(tiny, capacity=64, depth=8, k=2)
  ts = probe.times([1, 3], reps=2, sp=sp)
  assert set(ts) == {1, 3} and all(t.median > 0 for t in ts.values())
  again = probe.times([3], reps=2, sp=sp)  # warm: compiles nothing
  assert again[3].n_compiles == 0
  for simulated in (False, True):
    sc = plan.SpecConfig(tiny.cfg, tiny.cfg, 3, sp, simulated)
    assert probes.accept_cost(sc, reps=2, k=2).median > 0


def test_curve_is_written_as_costs_json_reads(tiny):
  probe = probes.CostProbe(tiny, capacity=64, depth=8, k=2)
  curve = costs.measure_curve(probe, probe, [1, 2], reps=1)
  d = curve.to_dict()
  assert sorted(int(k) for k in d["t_target_s"]) == [1, 2, 3]
  assert d["verify_ratio"]["1"] == 1.0 and d["c"] == pytest.approx(curve.t_draft / curve.t_target[1])
  jax.clear_caches()
