"""The XLA / PyTorch / llama.cpp comparison (specjax.bench.studies.batch_scaling, its report
and specjax.bench.backends) on tiny models.

Torch tests take the `transformers` fixture and are skipped without torch;
llama.cpp tests are skipped without the optional llamacpp extra (never in
the test extra or CI: it builds llama.cpp from source).
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from specjax.bench.studies import batch_scaling
from specjax.bench.studies import batch_scaling_report
from specjax.formats import gguf_write, hf
from specjax.metrics import theory
from specjax.bench.backends import base, llamacpp, pytorch
from specjax.bench.backends import xla as xla_lib
from specjax.model.config import get_preset
from specjax.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import configs.batch_scaling  # noqa: E402  pylint: disable=wrong-import-position

OUTPUTS = ("results.jsonl", "results.csv", "config.json", "parity.json",
           "scaling.png", "decode.png", "summary.md")


@pytest.fixture(scope="module")
def llama_cpp():
  pytest.importorskip("gguf", reason="llama.cpp tests need the optional "
                      "extra: pip install -e '.[llamacpp]'")
  return pytest.importorskip("llama_cpp", reason="llama.cpp tests need the "
                             "optional extra: pip install -e '.[llamacpp]'")


def tiny_config(**overrides):
  c = configs.batch_scaling.get_config("tiny")
  for k, v in overrides.items():
    c[k] = v
  return c


def assert_trees_equal(a, b):
  la, lb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
  assert [p for p, _ in la] == [p for p, _ in lb]
  for (path, x), (_, y) in zip(la, lb):
    assert x.dtype == y.dtype and x.shape == y.shape, path
    assert np.array_equal(np.asarray(x), np.asarray(y)), path

# ---------------------------------------------------------------- conversion


@pytest.mark.parametrize("preset,dtype", [("tiny", "float32"), ("tiny-mha", "float32"),
                                          ("tiny", "bfloat16")])
def test_round_trip_specjax_torch_specjax_is_exact(transformers, init_params,
                                                   preset, dtype):
  cfg = get_preset(preset, dtype)
  params = init_params(cfg)
  cfg2, params2 = hf.from_torch_model(hf.to_torch_model(cfg, params))
  assert cfg2 == cfg.replace(name="torch", attn_block=cfg2.attn_block)
  assert_trees_equal(params2, params)


def test_gguf_permute_is_the_interleaved_rope_layout():
  # One head of D = 4: rotate-half pairs (0, 2), (1, 3) become adjacent rows.
  w = np.arange(8, dtype=np.float32).reshape(4, 2)
  assert gguf_write.gguf_permute(w, 1)[:, 0].tolist() == [0, 4, 2, 6]
  # Per head, rows move only within their own head.
  w = np.arange(24, dtype=np.float32).reshape(12, 2)
  got = gguf_write.gguf_permute(w, 3)
  for h in range(3):
    assert sorted(got[4 * h:4 * h + 4, 0]) == sorted(w[4 * h:4 * h + 4, 0])


def test_write_gguf_holds_the_weights(llama_cpp, init_params, tmp_path):
  import gguf  # pylint: disable=import-outside-toplevel
  cfg = get_preset("tiny")
  params = init_params(cfg)
  path = gguf_write.write_gguf(tmp_path / "tiny.gguf", cfg, params)
  reader = gguf.GGUFReader(str(path))
  tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
  assert len(tensors) == 2 + 9 * cfg.n_layers + 1
  np.testing.assert_array_equal(tensors["token_embd.weight"],
                                np.asarray(params["embed"]["embedding"]))
  np.testing.assert_array_equal(tensors["blk.1.ffn_down.weight"],
                                np.asarray(params["layers_1"]["mlp"]["w_down"]["kernel"]).T)

# ---------------------------------------------------------------- parity


def test_check_parity_passes_and_fails_loudly():
  ref = np.linspace(-2, 2, 60, dtype=np.float32).reshape(1, 3, 20)
  assert base.check_parity(ref, ref + 1e-7, 1e-4, "x") < 1e-6
  with pytest.raises(base.ParityError, match=r"parity check failed: torch vs xla.*> tolerance"):
    base.check_parity(ref, ref + 0.1, 1e-4, "torch vs xla")
  with pytest.raises(base.ParityError, match="shapes"):
    base.check_parity(ref, ref[:, :2], 1e-4, "x")


def _xla_and_torch(cfg, params, corrupt=None):
  xla, th = xla_lib.XlaBackend(cfg, params), pytorch.TorchBackend(cfg, params, 1, "sdpa")
  if corrupt:
    corrupt(th.model)
  rng = np.random.RandomState(0)
  ctx, new = rng.randint(0, cfg.vocab_size, (2, 12)), rng.randint(0, cfg.vocab_size, (2, 3))
  for b in (xla, th):
    b.prepare(ctx, 32, 3)
  return xla.logits(new), th.logits(new)


def _corrupt_one_weight(model):
  import torch  # pylint: disable=import-outside-toplevel
  with torch.no_grad():
    model.model.layers[1].mlp.down_proj.weight[3, 5] += 0.5


def test_torch_cached_call_matches_xla(transformers, init_params):
  cfg = get_preset("tiny")
  ref, got = _xla_and_torch(cfg, init_params(cfg))
  assert base.parity_error(ref, got) < 1e-5


def test_parity_fails_loudly_on_a_corrupted_weight(transformers, init_params):
  cfg = get_preset("tiny")
  ref, got = _xla_and_torch(cfg, init_params(cfg), _corrupt_one_weight)
  with pytest.raises(base.ParityError, match="do not compute the same model"):
    base.check_parity(ref, got, base.parity_tolerance("torch", "float32"), "torch vs xla")


def test_run_stops_on_corrupted_torch_weights(transformers, tmp_path, monkeypatch):
  real = hf.to_torch_model

  def corrupted(cfg, params):
    model = real(cfg, params)
    _corrupt_one_weight(model)
    return model

  monkeypatch.setattr(pytorch.hf, "to_torch_model", corrupted)
  with pytest.raises(base.ParityError, match=r"torch vs xla, tiny float32"):
    batch_scaling.run_batch_scaling(tiny_config(backends=("xla", "torch")), str(tmp_path),
                              log=lambda s: None)
  assert not (tmp_path / "results.jsonl").exists()  # stopped before any timing


def test_llama_cpp_logits_match_xla(llama_cpp, init_params):
  cfg = get_preset("tiny")
  params = init_params(cfg)
  xla, ll = xla_lib.XlaBackend(cfg, params), llamacpp.LlamaCppBackend(cfg, params, 1)
  try:
    rng = np.random.RandomState(1)
    for b in (1, 2):
      ctx, new = rng.randint(0, 256, (b, 20)), rng.randint(0, 256, (b, 4))
      for backend in (xla, ll):
        backend.prepare(ctx, 32, 4)
      ref = xla.logits(new)
      assert base.parity_error(ref, ll.logits(new)) < 1e-5
      assert base.parity_error(ref, ll.logits(new)) < 1e-5  # rolled back
  finally:
    ll.close()

# ---------------------------------------------------------------- the run


def test_batch_scaling_end_to_end(transformers, tmp_path):
  records = batch_scaling.run_batch_scaling(tiny_config(), str(tmp_path), log=lambda s: None)
  for name in OUTPUTS:
    assert (tmp_path / name).stat().st_size > 0, name
  backends = {r["backend"] for r in records}
  assert {"xla", "xla-loop", "torch"} <= backends
  for r in records:
    assert r["median_s"] > 0 and r["reps"] == 2  # 1 rep x 2 rounds, pooled
    assert r["tps"] == pytest.approx(r["batch"] * r["n_tokens"] / r["median_s"])
    if r["batch"] == 1:
      assert r["ratio"] == pytest.approx(
          r["median_s"] / next(q["median_s"] for q in records if q["batch"] == 1
                               and q["n_tokens"] == 1 and q["backend"] == r["backend"]))
  assert not any(r["backend"] == "xla-loop" and r["batch"] > 1 for r in records)
  summary = (tmp_path / "summary.md").read_text()
  for text in ("## tiny float32, depth 16", "## Parity", "## Batched view",
               "leaves flat at N", "speedup α0.8 γ1", "- llama.cpp: "):
    assert text in summary, text
  lines = (tmp_path / "results.csv").read_text().splitlines()
  assert (lines[0].split(",") == list(batch_scaling_report.CSV_COLUMNS)
          and len(lines) == 1 + len(records))


def test_missing_llama_cpp_is_a_note_not_a_failure(tmp_path, monkeypatch):
  def missing():
    raise base.Unavailable("llama_cpp is not installed: pip install -e '.[llamacpp]'")
  monkeypatch.setattr(llamacpp, "_llama_cpp", missing)
  batch_scaling.run_batch_scaling(tiny_config(backends=("xla", "llama.cpp"), batches=(1,)),
                            str(tmp_path), log=lambda s: None)
  summary = (tmp_path / "summary.md").read_text()
  assert "- llama.cpp: unavailable (llama_cpp is not installed" in summary


def test_script_end_to_end(tmp_path):
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "experiments", "batch_scaling.py"),
       "--config=" + os.path.join(ROOT, "configs", "batch_scaling.py") + ":tiny",
       "--config.backends=xla,xla-loop", "--config.batches=1", "--config.rounds=1",
       f"--workdir={tmp_path}"], capture_output=True, text=True, timeout=300, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr
  assert "# Batch scaling" in proc.stdout and "xla-loop" in proc.stdout
  for name in OUTPUTS:
    assert (tmp_path / name).exists(), name


def test_script_bad_config_is_one_line(tmp_path):
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "experiments", "batch_scaling.py"),
       "--config=" + os.path.join(ROOT, "configs", "batch_scaling.py") + ":tiny",
       "--config.backends=torch", f"--workdir={tmp_path}"],
      capture_output=True, text=True, timeout=300, cwd=ROOT)
  assert proc.returncode == 1 and "Traceback" not in proc.stderr
  assert "error: config.backends must include 'xla'" in proc.stderr


def test_a_depth_past_a_presets_max_seq_len_is_refused_before_anything_runs(tmp_path):
  # cpu-draft (max_seq_len 1024) would run first; tiny (128) cannot take depth 127 + 2
  with pytest.raises(ConfigError, match="tiny: depth"):
    batch_scaling.run_batch_scaling(
        tiny_config(models=("cpu-draft", "tiny"), depths=(8, 127), backends=("xla",),
                    batches=(1,)), str(tmp_path), log=lambda s: None)
  assert not (tmp_path / "results.jsonl").exists()

# ---------------------------------------------------------------- reports


def test_settings_normalise_and_reject():
  c = batch_scaling.settings(tiny_config(backends=("xla,torch",), n_tokens=(4, 1, 2, 2)))
  assert c.backends == ("xla", "torch") and c.n_tokens == (1, 2, 4)
  for bad in (dict(backends=("torch",)), dict(backends=("xla", "onnx")),
              dict(n_tokens=(2, 4)), dict(batches=(2,)), dict(reps=0),
              dict(alpha=1.0), dict(compile_dynamic="maybe"), dict(dtypes=("f8",))):
    with pytest.raises(ConfigError):
      batch_scaling.settings(tiny_config(**bad))


def test_flat_region_and_cliffs():
  curve = {1: 1.0, 2: 1.1, 4: 1.2, 8: 1.3, 9: 2.5, 16: 4.4, 32: 8.8, 64: 20.0}
  leave, cliffs = batch_scaling_report.scaling_report(curve)
  assert leave == 8
  # 8 -> 9 jumps x1.9 for 1/8 more tokens; 16 -> 32 doubles with N (linear,
  # no cliff); 32 -> 64 is worse than linear.
  assert [(a, b) for a, b, _ in cliffs] == [(8, 9), (32, 64)]
  assert batch_scaling_report.scaling_report({1: 1.0, 2: 1.2}) == (None, [])


def test_allowed_speedup_is_theory_on_the_curve():
  flat = {n: 0.05 for n in (1, 2, 5, 8)}
  assert batch_scaling_report.allowed_speedup(flat, 0.8, 4, 0.1) == pytest.approx(
      float(theory.leviathan_speedup(0.8, 4, 0.1)))
  linear = {n: 0.05 * n for n in (1, 2, 5, 8)}
  assert batch_scaling_report.allowed_speedup(linear, 0.8, 4, 0.1) < 1.0
  assert batch_scaling_report.allowed_speedup(flat, 0.8, 8, 0.1) is None  # needs N = 9
