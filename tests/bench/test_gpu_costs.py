"""gpu_check's packed and surface parts without a GPU (bench/studies/gpu_costs.py):
the block sizes and the rectangles they compile, the sections written from
made-up records (the fitted surface's predicted speedup at bernoulli:0.829,
the refused points, the packed goal), and a point refused against the
device's memory on an accelerator, not the host's; three deliberate bugs."""

import pytest

from specjax.bench import memory
from specjax.bench.studies import cost_surface as cs
from specjax.bench.studies import cost_surface_report as report
from specjax.bench.studies import gpu_costs
from specjax.bench.studies import packed_verify_cost as pvc
from specjax.decode.probes import ragged_counts
from specjax.errors import ConfigError
from specjax.metrics import context_cost as cc
from specjax.model import config
from specjax.model import steps


def test_three_block_sizes_one_ragged_and_their_rectangles():
  assert gpu_costs.packed_sizes(1, 4) == [1, 3, 5]
  assert gpu_costs.packed_sizes(16, 4) == [16, 48, 80]
  assert gpu_costs.packed_sizes(64, 4) == [64, 192, 320]
  assert gpu_costs.packed_sizes(2, 2) == [2, 4, 6]
  counts = ragged_counts(16, 48, 4)  # the middle block: rows of 5 and of 1 token
  assert counts.sum() == 48 and counts.max() == 5 and counts.min() == 1
  # only the rectangles the records use are compiled: gamma + 1, and N / B
  assert pvc.rectangles(16, 4, [16, 48, 80]) == {1, 3, 5}
  assert pvc.rectangles(2, 2, [4]) == {2, 3}
  assert pvc.rectangles(2, 2, [3]) == {3}  # no rectangle of 1.5 tokens a row


def test_block_sizes_past_the_rows_are_refused(init_params):
  cfg = config.get_preset("tiny")
  target = steps.Runner(cfg, init_params(cfg))
  with pytest.raises(ConfigError, match=r"block sizes \[7\] at batch 2: each must lie in \[2, 6\]"):
    pvc.packed_cost(target, [2], 2, 8, 1, sizes=lambda b, g: [7])


def packed_records():
  rec = lambda b, n, same, ratio: {
      "batch": b, "n_tokens": n, "gamma": 4, "depth": 128, "dtype": "bfloat16",
      "t_packed_s": 0.010, "t_rect_full_s": 0.020, "ratio_full": 0.5,
      "t_rect_same_s": same, "ratio_same": ratio}
  return [rec(16, 48, 0.0095, 1.05), rec(16, 80, 0.0077, 1.3), rec(3, 7, None, None)]


def cells(text):
  """The rows of the markdown tables in text, as lists of stripped cells."""
  return [[c.strip() for c in l.split("|")[1:-1]] for l in text.splitlines() if l.startswith("|")]


def test_the_packed_section():
  text = "\n".join(gpu_costs.packed_section(packed_records(), "llama-7b"))
  assert "## Packed verify cost T_packed(B, N) (llama-7b, bfloat16, depth 128, gamma 4)" in text
  assert ["16", "48", "10.00", "20.00", "0.50", "9.50", "1.05"] in cells(text)
  assert ["3", "7", "10.00", "20.00", "0.50", "-", "-"] in cells(text)
  assert "Within 10 % of the same-N rectangle at 1 of 2 points" in text
  assert gpu_costs.packed_section([], "llama-7b")[-1] == "No point ran."


SLOT = cs.slot_bytes(config.get_preset("tiny"))
SETTINGS = gpu_costs.surface_settings("tiny", "float32", (512, 4096), (1, 4, 8), 4, 1,
                                      "streaming:256,4")


def surface_records():
  """A known surface: the target T = 10 ms (20 at N = 5) + 2 ms B + 1 ns per
  byte of KV, the streaming draft flat at 5 ms + 3 ms B + its window's KV."""
  recs = []
  for c in SETTINGS.contexts:
    for b in SETTINGS.batches:
      for role, n, slots in (("target", 1, c + 1), ("target", 5, c + 5),
                             ("streaming:256,4", 1, 264)):
        kv = b * slots * SLOT
        w = (0.005, 0.003) if role != "target" else (0.010 * (1 + (n > 1)), 0.002)
        recs.append({"context": c, "batch": b, "engine": "xla", "role": role, "n": n,
                     "seconds": w[0] + w[1] * b + 1e-9 * kv, "kv_bytes": kv,
                     "weight_bytes": 1, "kv_slots": slots})
  return recs + [{"context": 32768, "batch": 32, "refused": "context 32768 batch 32: refused, "
                  "needs about 1793.0 GiB, 60.1 GiB available"}]


def test_the_surface_section_predicts_at_the_smollm2_alpha():
  text = "\n".join(gpu_costs.surface_section(surface_records(), SETTINGS, (1, 4, 8, 16, 32)))
  assert "## Cost surface T(B, N, context) (tiny, float32, XLA, streaming:256,4 draft)" in text
  assert "- context 32768 batch 32: refused, needs about 1793.0 GiB" in text
  assert ["xla", "target", "1", "10.00", "2.00", "1000.0", "0%"] in cells(text)  # kappa ms/GB
  assert "`bernoulli:0.829`" in text
  want = cc.speedups(cc.StepModel((1, 5), (0.010, 0.020), (0.002, 0.002), 1e-9),
                     cc.StepModel((1,), (0.005,), (0.003,), 1e-9), cc.Reads(SLOT),
                     cc.Reads(SLOT, window=260), 0.829, 4, 4096, (1, 4, 8, 16, 32))
  rows = [c for c in cells(text) if c[:4] == ["xla", "streaming:256,4", "0.829", "4096"]]
  assert len(rows) == 1
  assert rows[0][4:9] == [f"{x:.2f}" for x in want]
  assert rows[0][9] == str(cc.turning_batch((1, 4, 8, 16, 32), want) or "none")
  # the fit predicts at contexts not measured too
  other = "\n".join(gpu_costs.surface_section(surface_records(), SETTINGS, (1, 4),
                                              contexts=(8192,)))
  assert [c[3] for c in cells(other) if c[:3] == ["xla", "streaming:256,4", "0.829"]] == ["8192"]


def test_the_surface_section_with_too_few_points():
  one_batch = [r for r in surface_records() if r.get("batch") == 4]
  assert gpu_costs.surface_section(one_batch, SETTINGS, (1, 4))[-1].startswith(
      "Not fitted: N = 1: the fit needs at least two batches")
  refused = surface_records()[-1:]
  assert gpu_costs.surface_section(refused, SETTINGS, (1, 4))[-1] == "No point ran."


def test_on_an_accelerator_the_device_pool_is_what_is_available(monkeypatch, init_params,
                                                                tmp_path):
  """The device's pool left (bytes_limit - bytes_in_use), not the host's
  memory: a point past it is refused in one line before anything runs."""
  monkeypatch.setattr(memory, "device_memory", lambda: {"bytes_limit": 3 << 20,
                                                    "bytes_in_use": 1 << 20})
  assert cs.available_bytes() == 2 << 20
  cfg = config.get_preset("tiny")
  s = gpu_costs.surface_settings("tiny", "float32", (16, 4000), (2,), 2, 1, "streaming:8,2",
                                 k=1)
  assert cs.estimate_bytes(cfg, s, 16, 2, {"streaming:8,2": cfg}) < 0.8 * (2 << 20)
  assert cs.estimate_bytes(cfg, s, 4000, 2, {"streaming:8,2": cfg}) > 2 << 20
  monkeypatch.setattr(cs.Point, "measure", lambda self, reps: {})  # measures nothing here
  lines = []
  recs = cs.run(tmp_path, cs.Settings(**{**vars(s), "contexts": (4000,)}),
                steps.Runner(cfg, init_params(cfg)), None, log=lines.append)
  assert len(recs) == 1 and recs[0]["refused"] == lines[-1]
  assert lines[-1].startswith("context 4000 batch 2: refused, needs about 0.0 GiB, "
                              "0.0 GiB available")
  monkeypatch.setattr(memory, "device_memory", lambda: {})  # the CPU: the host's memory
  assert cs.available_bytes() > 2 << 20


BUGS = {  # name: (module, attribute, mutant, the test it must fail)
    "the device's pool ignored (the host's memory on an accelerator)": (
        cs, "available_bytes", lambda f: lambda: 64 << 30,  # the host's 64 GiB, say
        test_on_an_accelerator_the_device_pool_is_what_is_available),
    "only the full rectangle compiled (no same-N rectangle)": (
        pvc, "rectangles", lambda f: lambda b, g, ns: {g + 1},
        test_three_block_sizes_one_ragged_and_their_rectangles),
    "the prediction at the alpha of the CPU sweeps (0.8), not SmolLM2's": (
        report, "crossovers", lambda f: lambda m, cfg, d, c, a, g, b: f(m, cfg, d, c, [0.8], g, b),
        test_the_surface_section_predicts_at_the_smollm2_alpha),
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_each_deliberate_bug_fails(monkeypatch, init_params, tmp_path, bug):
  module, name, make, test = BUGS[bug]
  monkeypatch.setattr(module, name, make(getattr(module, name)))
  kwargs = {"monkeypatch": monkeypatch, "init_params": init_params, "tmp_path": tmp_path}
  args = [kwargs[a] for a in test.__code__.co_varnames[:test.__code__.co_argcount]]
  with pytest.raises(AssertionError):
    test(*args)
