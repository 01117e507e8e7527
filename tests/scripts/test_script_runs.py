"""The long end-to-end script runs, apart from test_scripts.py so that the
suite's two workers (a file per worker) share them: the GPU script's smoke
path, the sharded bench, and the training pipeline with its resume."""

import json
import os

import pytest

from test_scripts import assert_one_line_error, run


def test_gpu_check_smoke(tmp_path):
  """The GPU script's whole path on tiny models (the real run needs a GPU),
  on two virtual devices so that its tensor-parallel part runs too."""
  proc = run("gpu_check.py", "--smoke", "--reps=1", f"--workdir={tmp_path}",
             env={"XLA_FLAGS": os.environ.get("XLA_FLAGS", "")
                  + " --xla_force_host_platform_device_count=2"})
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = (tmp_path / "gpu_summary.md").read_text()
  assert "FAILED" not in summary  # a part's error is caught on the GPU, never here
  assert "T(2)/T(1)" in summary and "| tiny |" in summary and "efficiency" in summary
  assert "| data:1,model:2 |" in summary and "Crossover, gamma 2" in summary
  assert "## Measured ceilings" in summary and "Ridge point" in summary
  assert "## Tree verify cost T(B, N)" in summary and "| 2 |" in summary
  parts = [json.loads(l)["part"] for l in (tmp_path / "gpu_check.jsonl").read_text().splitlines()]
  assert parts[0] == "peaks" and "bench" in parts
  assert (tmp_path / "sweep" / "results.jsonl").exists()
  # the task suite's part: its leaderboard and goals on the tiny target
  assert "## Task suite (tiny" in summary and "| ngram:1-4 | 0 | " in summary
  assert "## Goals" in summary and "taskbench" in parts
  assert (tmp_path / "taskbench" / "taskbench.md").exists()
  # the levers (issue 38 part 6): c per lever, then the sweep under one in its own process
  assert "## Levers: tiny-draft draft / tiny target" in summary and "| all | fused scan |" in summary
  assert "Best lever: " in summary and "random weights), under lever all" in summary
  assert "levers" in parts and (tmp_path / "lever_sweep" / "sweep" / "results.jsonl").exists()
  # issue 40's and 39's parts, last: one ragged packed block (every rectangle
  # it needs timed), two surface points (too few to fit: test_gpu_costs.py)
  assert parts.index("packed") < parts.index("surface") and parts[-1] == "surface"
  assert "## Packed verify cost T_packed(B, N) (tiny" in summary
  row = next(l for l in summary.splitlines() if l.startswith("| 2 | 4 |"))
  assert "-" not in row.replace(" ", "").strip("|").split("|"), row
  assert "## Cost surface T(B, N, context) (tiny, float32, XLA, streaming:8,2" in summary
  assert "Not fitted: N = 1: the fit needs at least two batches" in summary
  assert (tmp_path / "surface" / "results.jsonl").exists()


def test_mesh_bench_smoke(tmp_path):
  """mesh_bench's three parts on tiny models and two virtual devices: the
  report's tables (written from the records alone) and the loop's rows."""
  out = tmp_path / "mesh.json"
  proc = run("mesh_bench.py", "--host_devices=2", "--model=tiny", "--model_draft=tiny-draft",
             "--model_axes=2", "--spec_axis=2", "--draft_modes=replicated", "--reps=1",
             "--n_predict=6", "--depth=16", "--capacity=32", "--plan_model=tiny",
             "--plan_model_draft=tiny-draft", "--plan_mesh=data:1,model:2", "--plan_capacity=32",
             f"--json_out={out}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  for s in ("16 of 32 slots used, medians of 1", "| draft replicated |",
            "identical across draft placements: yes", "Plan: tiny + tiny-draft"):
    assert s in proc.stdout, s
  loop = [r for r in json.loads(out.read_text())["results"] if r["part"] == "loop"]
  assert [r["draft_sharding"] for r in loop] == [None, "replicated"]
  base, spec = loop[0]["rows"][0], loop[1]["rows"][0]
  assert base["prompt_ids"] == spec["prompt_ids"] and len(base["prompt_ids"]) == 32
  assert base["tokens"] == base["baseline_tokens"] == spec["baseline_tokens"]
  assert len(spec["tokens"]) == 6


def test_gpu_check_without_gpu_is_one_line(tmp_path):
  import jax
  if jax.default_backend() == "gpu":
    pytest.skip("a GPU is present")
  assert_one_line_error(run("gpu_check.py", f"--workdir={tmp_path}"), r"error: JAX does not see a GPU")


def test_train_pipeline_end_to_end_and_resume(tmp_path):
  wd, out = tmp_path / "w", tmp_path / "pair"
  proc = run("train.py", "--config=configs/train.py:tiny", f"--workdir={wd}",
             f"--export_dir={out}")
  assert proc.returncode == 0, proc.stderr
  assert "alpha at T=0" in proc.stdout and "held-out loss" in proc.stdout
  for name in ("tokenizer.json", "corpus.json", "alpha.json", "training.json", "training.png",
               "target/metrics.jsonl", "distill/metrics.jsonl"):
    assert (wd / name).stat().st_size > 0, name
  for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
    assert (out / "stdlib-target" / name).is_file() and (out / "stdlib-draft" / name).is_file()
  # the exported pair runs in the engine scripts with no conversion step
  proc = run("speculative.py", f"--model={out / 'stdlib-target'}",
             f"--model_draft={out / 'stdlib-draft'}", "--n_predict=8", "--draft=2",
             "--prompt=def f(x):")
  assert proc.returncode == 0, proc.stderr
  # a second run finds every stage finished and trains nothing
  again = run("train.py", "--config=configs/train.py:tiny", f"--workdir={wd}")
  assert again.returncode == 0, again.stderr
  assert "steps of" not in again.stdout and "resumed" not in again.stdout
  # a changed config is refused with one line
  bad = run("train.py", "--config=configs/train.py:tiny", f"--workdir={wd}",
            "--config.target_train.lr=0.001")
  assert_one_line_error(bad, "different config")
  bad = run("train.py", "--config=configs/train.py:tiny", f"--workdir={tmp_path / 'x'}",
            "--config.target_train.lr=2.0")
  assert_one_line_error(bad, "train.lr")
  # so are another corpus and other acceptance settings (before, both were reused:
  # the old tokenizer, and the old alpha printed under the new command)
  bad = run("train.py", "--config=configs/train.py:tiny", f"--workdir={wd}",
            "--config.vocab_size=280")
  assert_one_line_error(bad, r"corpus.json was made with other settings \(vocab_size: 300 -> "
                        r"280\); use a new --workdir")
  bad = run("train.py", "--config=configs/train.py:tiny", f"--workdir={wd}",
            "--config.alpha_temps=(0.0,)")
  assert_one_line_error(bad, r"alpha.json was made with other settings \(alpha_temps: "
                        r"\[0.0, 1.0\] -> \[0.0\]\); delete .*alpha.json to measure again")
