"""The benchmarks end to end on tiny models: tables, JSON lines, the
llama-batched-bench definitions, and the unrolled-vs-scan layer loop."""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from specjax.bench.studies import llama_bench as bench
from specjax.bench.studies import roofline
from specjax.bench import tables
from specjax.model import config
from specjax.model import kv_cache
from specjax.bench.studies import layer_loop
from specjax.model import llama as model
from specjax.model import steps
from specjax import workdir as wd
from specjax.errors import ConfigError
from specjax.metrics.timing import CompileWatch

ENV_KEYS = {"jax", "jaxlib", "backend", "device_kind", "cpu", "git_commit"}


@pytest.fixture(scope="module")
def tiny():
  # Its own name, so that no other test module has compiled its shapes.
  cfg = config.get_preset("tiny").replace(name="tiny-bench")
  return steps.Runner(cfg, model.init_params(cfg, seed=3))


def _cells(line):
  return [c.strip() for c in line.strip().strip("|").split("|")]


def _check_table(table, columns, n_rows):
  lines = table.splitlines()
  assert _cells(lines[0]) == list(columns)
  assert len(lines) == 2 + n_rows
  assert len({line.count("|") for line in lines}) == 1  # no stray '|' in a cell


def test_llama_bench_table_json_lines_and_compiles_once(tiny, tmp_path):
  load = lambda spec, dtype, seed: (tiny.cfg.with_dtype(dtype), tiny.params, None)
  path = tmp_path / "bench.jsonl"
  seen = []
  on_record = lambda r: (seen.append(r["test"]), wd.append_jsonl(str(path), [r]))
  with CompileWatch() as cw:
    recs = bench.run_bench(["tiny"], ["f32"], [4, 1, 2], n_gen=3, n_depth=5,
                           reps=2, on_record=on_record, load=load)
  # pp sizes ascending (pp1 first: the verify_ratio base), then tg.
  assert seen == ["pp1 @ d5", "pp2 @ d5", "pp4 @ d5", "tg3 @ d5"]
  assert cw.names["forward_step"] == 3  # T = 1, 2, 4: tg3 reuses T = 1
  _check_table(bench.bench_table(recs), bench.BENCH_COLUMNS, 4)
  row = _cells(bench.bench_table(recs).splitlines()[2])
  assert row[:6] == ["tiny-bench", tables.format_size(model.param_bytes(tiny.params)),
                     tables.format_params(model.param_count(tiny.params)), "cpu",
                     "float32", "pp1 @ d5"]
  assert "±" in row[6]
  lines = [json.loads(l) for l in path.read_text().splitlines()]
  assert [l["test"] for l in lines] == seen
  for l in lines:
    assert ENV_KEYS <= set(l["env"])
    assert l["capacity"] == 16 and l["reps"] == 2 and len(l["times_s"]) == 2
    assert l["tps_mean"] == pytest.approx(np.mean([l["n_tokens"] / t for t in l["times_s"]]))
  ratios = {l["test"]: l["verify_ratio"] for l in lines}
  assert ratios["pp1 @ d5"] == 1.0 and ratios["pp4 @ d5"] > 0
  assert ratios["tg3 @ d5"] is None
  assert lines[3]["ms_per_call"] == pytest.approx(1e3 * lines[3]["median_s"] / 3)
  assert "T(N)/T(1)" in bench.verify_curve_table(recs)


def test_batched_bench_follows_llama_cpp_definitions(tiny):
  recs = bench.run_batched_bench(tiny, batches=[1, 2], pps=[8], tgs=[3], reps=2)
  _check_table(bench.batched_table(recs), bench.BATCHED_COLUMNS, 2)
  for r, b in zip(recs, [1, 2]):
    assert (r["pp"], r["tg"], r["batch"]) == (8, 3, b)
    assert r["n_kv"] == b * (8 + 3)
    assert r["t_s"] == pytest.approx(r["t_pp_s"] + r["t_tg_s"])
    assert r["s_pp_tps"] == pytest.approx(b * 8 / r["t_pp_s"])
    assert r["s_tg_tps"] == pytest.approx(b * 3 / r["t_tg_s"])
    assert r["s_tps"] == pytest.approx(r["n_kv"] / r["t_s"])
    assert r["t_pp_s"] == r["timing_pp"]["median_s"]
    json.loads(json.dumps(r))


@pytest.mark.parametrize("name,tied", [("tiny", False), ("tiny-mha", True)])
def test_scan_variant_equals_unrolled_model(name, tied):
  cfg = config.get_preset(name).replace(tie_embeddings=tied)
  params = model.init_params(cfg, seed=1)
  toks = jnp.asarray(np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 9)), jnp.int32)
  ref = steps.forward_step(params, toks, kv_cache.init_cache(cfg, 2, 16), cfg=cfg)[0]
  sp, cache = layer_loop.scan_params(params, cfg), layer_loop.init_scan_cache(cfg, 2, 16)
  outs = []
  for s, e in ((0, 6), (6, 7), (7, 8), (8, 9)):  # a chunk, then one token at a time
    logits, cache = layer_loop.scan_step(sp, toks[:, s:e], cache, cfg=cfg)
    outs.append(logits)
  np.testing.assert_allclose(jnp.concatenate(outs, 1), ref, atol=1e-5)
  assert np.asarray(cache[2]).tolist() == [9, 9]


def test_layer_loop_bench_runs_and_compares_like_for_like(tmp_path):
  recs = layer_loop.run_layer_loop_bench("tiny", capacity=32, depth=7, reps=3,
                                    compile_presets=["tiny-mha"])
  assert [(r["model"], r["variant"]) for r in recs] == [
      ("tiny", "unrolled"), ("tiny", "scan"), ("tiny-mha", "unrolled"), ("tiny-mha", "scan")]
  for r in recs[:2]:
    assert r["max_abs_logit_diff"] < 1e-5
    assert r["ms_per_step"] > 0 and r["compile_s"] > 0 and r["decode"]["reps"] == 3
  for r in recs[2:]:  # compiled from ShapeDtypeStructs, never run
    assert r["ms_per_step"] is None and r["compile_s"] > 0 and r["n_layers"] == 2
  _check_table(layer_loop.layer_loop_table(recs), layer_loop.LAYER_LOOP_COLUMNS, 4)
  wd.append_jsonl(str(tmp_path / "ll.jsonl"), recs)
  assert len((tmp_path / "ll.jsonl").read_text().splitlines()) == 4


def test_units_and_flag_parsing():
  assert tables.format_size(3 * 1024 ** 2) == "3.00 MiB"
  assert tables.format_size(int(3.5 * 1024 ** 3)) == "3.50 GiB"
  assert tables.format_params(162_420_000) == "162.42 M"
  assert tables.format_params(6_740_000_000) == "6.74 B"
  assert tables.parse_ints("1, 2,4") == [1, 2, 4] == tables.parse_ints(["1", "2", "4"])
  assert kv_cache.round_capacity(160) == 160 and kv_cache.round_capacity(161) == 176
  for bad in ("", "1,x", "0"):
    with pytest.raises(ConfigError):
      tables.parse_ints(bad)
  with pytest.raises(ConfigError):
    bench.run_bench(["tiny"], ["float32"], [1], n_gen=1, n_depth=0, reps=0)


def test_roofline_bound_is_flat_to_the_ridge_and_compute_bound_past_it():
  # 1 M weights of 4 bytes at 10 GB/s: 0.4 ms to read; 2 M FLOPs per row at
  # 100 GFLOP/s: 0.02 ms per row -> ridge at 100 * 4 / (2 * 10) = 20 rows.
  read = 1e6 * 4 / 10e9
  for m in (1, 8, 20):
    assert roofline.roofline_bound(m, 1_000_000, 4, 100.0, 10.0) == pytest.approx(read)
  assert roofline.roofline_bound(40, 1_000_000, 4, 100.0, 10.0) == pytest.approx(2 * read)
  # half the bytes: half the read time, the same compute -> ridge at 10 rows
  assert roofline.roofline_bound(5, 1_000_000, 2, 100.0, 10.0) == pytest.approx(read / 2)
  assert roofline.roofline_bound(40, 1_000_000, 2, 100.0, 10.0) == pytest.approx(2 * read)
  peaks = roofline.measure_peaks(reps=1, n=64, read_mib=1)
  assert peaks["peak_gflops"] > 0 and peaks["read_gbs"] > 0 and peaks["compile_s"] > 0


def _script(name, *args):
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  return subprocess.run([sys.executable, os.path.join(root, "experiments", name), *args],
                        capture_output=True, text=True, timeout=300, cwd=root)


def test_dot_bench_prints_the_roofline_next_to_the_measured_products(tmp_path):
  out = tmp_path / "dot.json"
  proc = _script("dot_bench.py", "--model=tiny", "--m=1,2", "--reps=1", "--k=1",
                 f"--json_out={out}")
  assert proc.returncode == 0, proc.stderr
  assert "ridge point at M =" in proc.stdout and "| 2 |" in proc.stdout
  roof = json.loads(out.read_text())["roofline"]
  assert [r["m"] for r in roof["rows"]] == [1, 2] and roof["layer_params"] == 64 * (2 * 64 + 2 * 32) + 3 * 64 * 128


def test_decode_profile_ablates_attention_and_times_the_projections(tmp_path):
  out = tmp_path / "prof.json"
  proc = _script("decode_profile.py", "--model=tiny", "--depth=8", "--reps=1", "--k=2",
                 f"--json_out={out}")
  assert proc.returncode == 0, proc.stderr
  recs = json.loads(out.read_text())["results"]
  assert [r["variant"] for r in recs] == ["full", "no attention", "no norms", "no rope",
                                         "projections"]
  assert all(r["ms"] > 0 and r["bound_ms"] > 0 for r in recs)
  diff = {r["variant"]: r["max_abs_logit_diff"] for r in recs}
  assert diff["full"] == 0 and all(diff[v] > 0 for v in ("no attention", "no norms", "no rope"))
  assert "| tiny | 8 |" in proc.stdout
  bad = _script("decode_profile.py", "--model=tiny", "--dtype=int8", "--reps=1")
  assert bad.returncode != 0 and "Traceback" not in bad.stderr and "int8" in bad.stderr
