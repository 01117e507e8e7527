"""The gamma sweep's cost probes at batch B (gamma.Bench.probe): a drafter
whose proposal reads the batch's shared cache (streaming) is probed at B,
a model-free one keeps its batch-1 probe, and the target's probe at B is
made once for every drafter of the sweep (each holds a cache of B rows at
the sweep's depth); deliberate bugs (the flag ignored: streaming priced at
batch 1, as before; a target probe per drafter) must fail."""

import types

import pytest

from specjax.bench.sweep import gamma
from specjax.drafters import registry
from specjax.drafters import streaming


class Loop:
  """Stands in for engine.Loop: records which probes the bench asks for."""
  target = "target"

  def __init__(self):
    self.asked = []

  def cost_probe(self, m, depth, batch=1):
    self.asked.append(("cost", m, batch))
    return ("cost", m, batch)

  def draft_probe(self, d, g, depth, batch=1):
    self.asked.append(("draft", d.spec, g, batch))
    return ("draft", d.spec, g, batch)


def probes_at(spec: str, batch: int):
  loop = Loop()
  setup = types.SimpleNamespace(loop=loop, depth=12)
  batch1 = types.SimpleNamespace(sc=types.SimpleNamespace(gamma=4))
  bench = gamma.Bench(setup, registry.parse(spec), "t1", batch1)
  return bench.probe(batch), batch1


def test_streaming_is_probed_at_the_points_batch():
  (target, draft), _ = probes_at("streaming:16,2", 4)
  assert target == ("cost", "target", 4)
  assert draft == ("draft", "streaming:16,2", 4, 4)


def test_ngram_keeps_its_batch_one_probe():
  (target, draft), batch1 = probes_at("ngram", 4)
  assert target == ("cost", "target", 4) and draft is batch1


def test_the_flag_ignored_fails(monkeypatch):
  monkeypatch.setattr(streaming.StreamingDrafter, "reads_batch_cache", False)
  with pytest.raises(AssertionError):
    test_streaming_is_probed_at_the_points_batch()


class SweepLoop(Loop):
  """Loop whose batch-1 draft probe carries its gamma, as a real one does."""

  def draft_probe(self, d, g, depth, batch=1):
    probe = super().draft_probe(d, g, depth, batch)
    return types.SimpleNamespace(sc=types.SimpleNamespace(gamma=g)) if batch == 1 else probe


def target_probes_asked() -> int:
  """How many target probes at batch 4 a sweep of two drafters asks the loop for
  (gamma.drafter_benches, as GammaRunner.measure builds them)."""
  loop = SweepLoop()
  drafters = [registry.parse(x) for x in ("streaming:16,2", "ngram")]
  setup = types.SimpleNamespace(loop=loop, depth=12, drafters=drafters)
  for bench in gamma.drafter_benches(setup, "t1", 4).values():
    bench.probe(4)
  return sum(a[0] == "cost" and a[1] == "target" for a in loop.asked)


def test_the_targets_probe_is_made_once_for_every_drafter():
  assert target_probes_asked() == 1


def _unshared_benches(setup, probe_t, gamma_max):
  """The bug: each drafter's Bench makes its own target probes."""
  return {d.spec: gamma.Bench(setup, d, probe_t, setup.loop.draft_probe(d, gamma_max, 12))
          for d in setup.drafters}


def test_a_target_probe_per_drafter_fails(monkeypatch):
  monkeypatch.setattr(gamma, "drafter_benches", _unshared_benches)
  with pytest.raises(AssertionError):
    test_the_targets_probe_is_made_once_for_every_drafter()
