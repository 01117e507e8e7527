"""The cost surface (bench/studies/cost_surface.py) on the tiny target: every
(context, batch, engine, step, N) recorded with the bytes it reads, parity
first, a point that would not fit refused in one line, a resume that
measures nothing again and other settings refused; the report written."""

import json

import pytest

from specjax.bench.backends import base as backends
from specjax.bench.backends.torch_llama import TorchLlama
from specjax.bench.studies import cost_surface as cs
from specjax.bench.studies import cost_surface_report as report
from specjax.errors import ConfigError
from specjax.model import config
from specjax.model import llama
from specjax.model import steps

SETTINGS = cs.Settings(model="tiny", dtype="float32", contexts=(16, 24), batches=(2,),
                       ns=(1, 3), drafters=("streaming:8,2",), gamma=2, reps=1, k=1)


@pytest.fixture(scope="module")
def models(transformers, init_params):
  del transformers
  cfg = config.get_preset("tiny")
  params = init_params(cfg, 1)  # test_torch_spec.py's: one init in the suite
  return steps.Runner(cfg, params), TorchLlama(cfg, params, compile=False, threads=1)


@pytest.fixture(scope="module")
def surface(models, tmp_path_factory):
  work = tmp_path_factory.mktemp("surface")
  lines = []
  recs = cs.run(work, SETTINGS, *models, log=lines.append)
  return work, recs, lines


def test_every_point_is_recorded_with_its_bytes(models, surface):
  target, _ = models
  _, recs, lines = surface
  assert lines[0].startswith("parity: target")
  keys = {(r["context"], r["batch"], r["engine"], r["role"], r["n"]) for r in recs}
  want = {(c, b, e, role, n) for c in (16, 24) for b in (2,) for e in ("xla", "torch")
          for role, n in (("target", 1), ("target", 3), ("streaming:8,2", 1))}
  assert keys == want
  slot = cs.slot_bytes(target.cfg)
  assert slot == 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 kv heads, d_head 16, f32
  for r in recs:
    assert r["seconds"] > 0 and r["kv_bytes"] == r["batch"] * r["kv_slots"] * slot
    if r["role"] == "streaming:8,2":
      assert r["kv_slots"] == 2 + 8 + 2  # sinks, window, gamma: flat in the context
    elif r["engine"] == "xla":  # whole 8-slot blocks up to the length
      assert r["kv_slots"] == -(-(r["context"] + r["n"]) // 8) * 8
    assert r["weight_bytes"] == llama.param_bytes(target.params)  # the draft's: the target's
  assert all("peak_rss_bytes" in r and "estimate_bytes" in r for r in recs)


def test_a_resume_measures_nothing_and_other_settings_are_refused(models, surface, monkeypatch):
  work, recs, _ = surface
  monkeypatch.setattr(cs.Point, "measure", lambda self, reps: pytest.fail("measured again"))
  assert cs.run(work, SETTINGS, *models, log=lambda _: None) == recs
  with pytest.raises(ConfigError, match="reps: 1 -> 2"):
    cs.run(work, cs.Settings(**{**vars(SETTINGS), "reps": 2}), *models)


def test_a_point_that_does_not_fit_is_refused_in_one_line(models, tmp_path, monkeypatch):
  monkeypatch.setattr(cs, "available_bytes", lambda: 1 << 10)
  lines = []
  s = cs.Settings(**{**vars(SETTINGS), "contexts": (16,), "batches": (2,)})
  recs = cs.run(tmp_path, s, *models, log=lines.append)
  assert len(recs) == 1 and "refused, needs about" in recs[0]["refused"]
  assert lines[-1] == recs[0]["refused"] and "\n" not in lines[-1]


def test_parity_refuses_other_weights(models, tmp_path):
  target, _ = models
  other = TorchLlama(target.cfg, dict(target.params, lm_head={
      "kernel": target.params["lm_head"]["kernel"] * 1.01}), compile=False, threads=1)
  with pytest.raises(backends.ParityError, match="the target's decode step"):
    cs.run(tmp_path, SETTINGS, target, other)


@pytest.fixture(scope="module")
def head(models, tmp_path_factory):
  """'eagle:PATH' of a random head for the tiny target."""
  cfg = models[0].cfg
  hcfg = cs.eagle.head_config(cfg)
  return "eagle:" + str(cs.eagle.save_head(tmp_path_factory.mktemp("head") / "h", hcfg,
                                           cs.eagle.init_head(hcfg, 3), cfg, "tiny"))


def test_an_eagle_head_in_both_engines(models, head, tmp_path, monkeypatch):
  target, _ = models
  s = cs.Settings(model="tiny", dtype="float32", contexts=(16,), batches=(2,), ns=(1,),
                  drafters=(head,), gamma=2, reps=1, k=1)
  lines = []
  recs = {(r["engine"], r["role"]): r for r in cs.run(tmp_path / "a", s, *models,
                                                       log=lines.append)}
  assert f"{head} " in lines[0]  # its parity, torch against XLA
  assert set(recs) == {(e, role) for e in ("xla", "torch") for role in ("target", head)}
  cap, hcfg = cs.capacity_of(16, s), cs.eagle.head_config(target.cfg)
  assert recs["xla", head]["kv_slots"] == 16 + 2  # its own cache at the context, the drafts
  assert recs["torch", head]["kv_slots"] == cap  # torch's masked pass: the capacity
  assert recs["torch", head]["kv_bytes"] == 2 * cap * cs.slot_bytes(hcfg)
  assert recs["torch", head]["weight_bytes"] == recs["xla", head]["weight_bytes"]
  assert all(r["seconds"] > 0 for r in recs.values())
  # a head converted wrong is refused before any point runs
  logits = cs.torch_eagle.TorchEagleHead.logits
  monkeypatch.setattr(cs.torch_eagle.TorchEagleHead, "logits", lambda h, g: logits(h, 1.01 * g))
  with pytest.raises(backends.ParityError, match="'s head"):
    cs.run(tmp_path / "b", s, *models)


def test_a_draft_model_in_both_engines(models, tmp_path):
  """The draft model's forward on its own cache (here the tiny target as its
  own draft), timed in both engines; its weights are the draft's (a run
  handed the draft's params where its Runner was due: a traceback, up to 063d293)."""
  target, tmodel = models
  s = cs.Settings(model="tiny", dtype="float32", contexts=(16,), batches=(2,), ns=(1,),
                  drafters=("model",), gamma=2, reps=1, k=1, model_draft="tiny")
  recs = {(r["engine"], r["role"]): r
          for r in cs.run(tmp_path, s, target, tmodel, target, tmodel, log=lambda _: None)}
  assert set(recs) == {(e, role) for e in ("xla", "torch") for role in ("target", "model")}
  cap = cs.capacity_of(16, s)
  assert recs["xla", "model"]["kv_slots"] == 16 + 2 and recs["torch", "model"]["kv_slots"] == cap
  assert recs["torch", "model"]["weight_bytes"] == llama.param_bytes(target.params)
  other = TorchLlama(target.cfg, dict(target.params, lm_head={
      "kernel": target.params["lm_head"]["kernel"] * 1.01}), compile=False, threads=1)
  with pytest.raises(backends.ParityError, match="the draft model's decode step"):
    cs.run(tmp_path / "b", s, target, tmodel, target, other)


def synthetic(engine, slot, contexts=(512, 2048, 4096), batches=(1, 4, 8)):
  """Records of a known surface: T = 10 ms + 2 ms B + 1 ns per byte of KV
  for the target (N = 1, 5; the verify's weights term twice the decode's), a
  flat streaming draft at 5 ms + 3 ms B + the same kappa."""
  recs = []
  for c in contexts:
    for b in batches:
      for role, n, slots in (("target", 1, c + 1), ("target", 5, c + 5),
                             ("streaming:256,4", 1, 264)):
        kv = b * slots * slot
        w = (0.005, 0.003) if role != "target" else (0.010 * (1 + (n > 1)), 0.002)
        recs.append({"context": c, "batch": b, "engine": engine, "role": role, "n": n,
                     "seconds": w[0] + w[1] * b + 1e-9 * kv, "kv_bytes": kv,
                     "weight_bytes": 1, "kv_slots": slots})
  return recs + [{"context": 8192, "batch": 16, "refused": "context 8192 batch 16: refused"}]


def test_the_report(models, tmp_path):
  target, _ = models
  slot = cs.slot_bytes(target.cfg)
  s = cs.Settings(**{**vars(SETTINGS), "contexts": (512, 4096), "drafters": ("streaming:256,4",),
                     "gamma": 4})
  text = report.write(tmp_path, synthetic("xla", slot), target.cfg,
                      {"streaming:256,4": target.cfg}, s, [0.8], [1, 2, 4, 8, 16], {})
  assert "torch/XLA" in text and "- context 8192 batch 16: refused" in text
  assert "torch: not fitted (the KV term cannot be told" not in text  # no torch records: none
  saved = json.loads((tmp_path / "crossover.json").read_text())
  fit = saved["fits"]["xla"]
  assert fit["target"]["kappa"] == pytest.approx(1e-9, rel=1e-6)
  assert fit["target"]["w0"] == pytest.approx([0.010, 0.020], rel=1e-6)
  assert fit["streaming:256,4"]["w1"] == pytest.approx([0.003], rel=1e-6)
  turns = {r["context"]: r["turning_batch"] for r in saved["crossovers"]["xla"]}
  assert set(turns) == {512, 4096}
  assert (tmp_path / "surface.png").stat().st_size > 0


def by_hand_records(target):
  """point_records on made-up times: what each step reads, by hand."""
  times = {("xla", "target", 1): [1.0], ("torch", "target", 3): [2.0],
           ("xla", "streaming:8,2", 1): [0.5], ("torch", "streaming:8,2", 1): [0.5]}
  recs = cs.point_records(target.cfg, {"streaming:8,2": target.cfg},
                          {"target": 7, "streaming:8,2": 7}, SETTINGS, 40, 2, times)
  return {(r["engine"], r["role"]): r["kv_slots"] for r in recs}


SKIP = "streaming:8,2+layerskip:1"


def test_the_bytes_each_step_reads_by_hand(models):
  slots = by_hand_records(models[0])
  cap = cs.capacity_of(40, SETTINGS)
  assert cap == 48
  assert slots == {("xla", "target"): 48,  # 41 slots in whole 8-slot blocks
                   ("torch", "target"): cap,  # the masked pass reads the capacity
                   ("xla", "streaming:8,2"): 2 + 8 + 2, ("torch", "streaming:8,2"): 12}
  # a +layerskip:1 window reads its slots over the one layer it runs (XLA only)
  cfg = models[0].cfg
  dcfg = cs.registry.parse(SKIP).draft_config(cfg, None)
  s = cs.Settings(model="tiny", dtype="float32", contexts=(40,), batches=(2,), ns=(1,),
                  drafters=(SKIP,), engines=("xla",), gamma=2)
  (rec,) = cs.point_records(cfg, {SKIP: dcfg}, {SKIP: 7}, s, 40, 2, {("xla", SKIP, 1): [0.5]})
  assert dcfg.n_layers == 1 and rec["kv_slots"] == 12
  assert rec["kv_bytes"] == 2 * 12 * cs.slot_bytes(cfg) // cfg.n_layers


def test_a_shortened_draft_is_timed_in_xla_alone():
  with pytest.raises(ConfigError, match="--engines=xla"):
    cs.Settings(model="tiny", dtype="float32", contexts=(16,), batches=(2,), ns=(1,),
                drafters=(SKIP,))
  # a draft model's probe is its own forward, full head: a reduced one would be mislabelled
  with pytest.raises(ConfigError, match="drop :vocab="):
    cs.Settings(model="tiny", dtype="float32", contexts=(16,), batches=(2,), ns=(1,),
                drafters=("model:vocab=8",), engines=("xla",), model_draft="tiny")


BUGS = {  # name: (module, attribute, mutant)
    "XLA's KV counted at the used length, not in whole blocks": (
        cs.roofline, "attended_slots", lambda f: lambda cfg, cap, n: min(cap, n)),
    "the streaming draft's reads not cut at its window": (
        cs, "draft_reads", lambda f: lambda d, cfg, dcfg, c, g: (c + g, cs.slot_bytes(cfg))),
    "a +layerskip:K window's reads counted over every layer": (
        cs, "draft_reads", lambda f: lambda d, cfg, dcfg, c, g: (f(d, cfg, dcfg, c, g)[0],
                                                                 cs.slot_bytes(cfg))),
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_each_deliberate_bug_fails(models, monkeypatch, bug):
  module, name, make = BUGS[bug]
  monkeypatch.setattr(module, name, make(getattr(module, name)))
  with pytest.raises(AssertionError):
    test_the_bytes_each_step_reads_by_hand(models)
