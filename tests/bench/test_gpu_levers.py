"""gpu_check's issue-38 parts without a GPU: the new head's task-suite rows
left out with one line while the head is missing, the levers part's c and
roofline from its records, and --lever refused without its XLA flags."""

import json
import os
import subprocess
import sys

import pytest

from configs import sweep_gamma
from specjax.bench.studies import draft_levers
from specjax.bench.studies import gpu_study as gs
from specjax.bench.sweep.config import SweepConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_new_head_is_left_out_with_one_line_until_shipped(monkeypatch, tmp_path):
  monkeypatch.setattr(gs, "NEW_HEAD", f"eagle3:{tmp_path / 'no-head'}")
  cfg = SweepConfig.from_mapping(sweep_gamma.get_config("taskbench_quick"))
  cfg = cfg.replace(drafters=("ngram",), taskbench_trees=())
  sub, dropped = gs.taskbench_available(gs.with_new_head(cfg))
  assert sub.drafters == ("ngram",) and sub.taskbench_trees == ()
  assert len(dropped) == 1, dropped
  assert dropped[0].startswith(f"eagle3:{tmp_path / 'no-head'}: left out (EAGLE-3 head ")


def _rec(lever, role, ms, n_params, step_bytes=0):
  return {"lever": lever, "role": role, "ms_per_token": ms, "n_params": n_params,
          "dtype": "bfloat16", "depth": 128, "capacity": 512, "attention": "masked",
          "scan_layers": role == "draft" and lever != "default", "compile_s": 1.0,
          "step_bytes": step_bytes}


def test_c_and_the_roofline_from_the_records():
  """c = T_draft / T_target under the same lever; the best is the smallest;
  the roofline share is the step's bytes over its time and the bandwidth."""
  recs = [_rec("default", "draft", 0.8, 160), _rec("default", "target", 8.0, 7000, 13.2e9),
          _rec("all", "draft", 0.4, 160), _rec("all", "target", 12.0, 7000, 13.2e9)]
  assert draft_levers.c_by_lever(recs) == pytest.approx({"default": 0.1, "all": 0.4 / 12})
  assert draft_levers.best_lever(recs) == "all"
  text = "\n".join(draft_levers.levers_section(recs, "llama-160m", "llama-7b", 4800.0))
  assert "| default | masked | 0.800 | 8.000 | 0.100 | 34% |" in text  # 13.2 GB / 8 ms / 4.8 TB/s
  assert "| all | masked scan | 0.400 | 12.000 | 0.033 | 23% |" in text
  assert "Best lever: all, c = 0.033 (goal <= 0.08; the parameter ratio is 0.023)" in text
  failed = recs[:2] + [{**_rec("fused", "draft", None, 160), "error": "XlaRuntimeError: cuDNN"},
                       _rec("fused", "target", 9.0, 7000, 13.2e9)]
  assert draft_levers.best_lever(failed) == "default"  # a failed lever is never the best
  text = "\n".join(draft_levers.levers_section(failed, "llama-160m", "llama-7b", None))
  assert "| fused | masked scan | failed: XlaRuntimeError: cuDNN |" in text
  assert draft_levers.best_lever([failed[2], failed[3]]) is None


def test_a_failing_lever_is_one_row_not_the_end(monkeypatch):
  """A lever that raises where it is measured (cuDNN refusing a shape) is
  recorded with its error; the other levers are still measured."""
  def cost(cfg, *args):
    if cfg.attention == "fused":
      raise RuntimeError("cuDNN: unsupported\nmore")
    return {"ms_per_token": 1.0, "compile_s": 0.0, "times_s": [0.0]}

  monkeypatch.setattr(draft_levers, "decode_cost", cost)
  recs = draft_levers.lever_costs("tiny-draft", "tiny", "float32", ("default", "fused"),
                                  32, 4, 2, 1)
  assert [r.get("error") for r in recs] == [None, None, "RuntimeError: cuDNN: unsupported",
                                            "RuntimeError: cuDNN: unsupported"]


def test_a_lever_without_its_xla_flags_is_one_line(tmp_path):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "gpu_check.py"),
                         "--smoke", "--lever=command_buffers", f"--workdir={tmp_path}"],
                        capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
  assert proc.returncode == 1 and "Traceback" not in proc.stderr
  assert proc.stderr.strip().splitlines()[-1].startswith(
      "error: --lever=command_buffers needs XLA_FLAGS to hold --xla_gpu_enable_command_buffer=")
  assert not os.listdir(tmp_path)  # refused before the workdir is touched


def test_a_script_under_a_lever_gives_the_same_tokens(tmp_path):
  """cli's --lever with its XLA flags: the model loads under it (the run's
  config says so) and greedy decoding gives the default's tokens."""
  from specjax.model import levers  # pylint: disable=import-outside-toplevel
  runs = {}
  for lever in ("default", "all"):
    out = tmp_path / f"{lever}.json"
    env = {**os.environ, "XLA_FLAGS": " ".join(
        [os.environ.get("XLA_FLAGS", ""), levers.parse(lever).xla_flags()])}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "generate.py"),
                           "--model=tiny", "--n_predict=12", "--prompt_tokens=4,5,6",
                           f"--lever={lever}", f"--json_out={out}"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs[lever] = json.loads(out.read_text())
  assert runs["all"]["tokens"] == runs["default"]["tokens"]
  assert (runs["default"]["config"]["attention"], runs["all"]["config"]["attention"]) == (
      "auto", "fused")


@pytest.mark.parametrize("backend,slots", [("cpu", 256), ("gpu", 4096)])
def test_the_bench_roofline_reads_what_the_backend_ran(backend, slots):
  """The bench part's roofline counts the cache slots the loaded kind read:
  blocks up to the used length on the CPU, the whole capacity on a GPU."""
  from specjax.bench.studies import roofline  # pylint: disable=import-outside-toplevel
  from specjax.model import config  # pylint: disable=import-outside-toplevel
  cfg = config.get_preset("llama-160m", "bfloat16")
  base = {"model": cfg.name, "capacity": 4096, "size_bytes": 324_000_000, "backend": backend}
  recs = [{**base, "kind": "tg", "median_s": 0.064, "n_tokens": 64, "n_params": 162_000_000},
          {**base, "kind": "pp", "n_tokens": 1, "median_s": 0.001, "verify_ratio": 1.0},
          {**base, "kind": "pp", "n_tokens": 2, "median_s": 0.001, "verify_ratio": 1.0}]
  text = "\n".join(gs.bench_section(recs, ["llama-160m"], "bfloat16", [1, 2], 64, 128, 4800.0))
  want = roofline.roofline_fraction(cfg, 324_000_000, slots, 0.001, 4800.0)
  assert f"| llama-160m | 1000.0 | 1.00 | {100 * want:.0f}% of 4800 GB/s |" in text
