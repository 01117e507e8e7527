"""The gamma x acceptance sweep: measured speedup next to the theory's.

  python experiments/sweep_gamma.py --config=configs/sweep_gamma.py:quick --workdir=/tmp/specjax_quick

Writes results.jsonl (one line per point, as it finishes), results.csv,
config.json, costs.json, speedup.png, verify_cost.png and summary.md into
--workdir. --resume skips the points already in results.jsonl.
"""

import os
import sys

from absl import flags

from specjax import cli
from specjax.bench import sweep
from specjax.bench import taskbench_run

_CONFIG = cli.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "..", "configs", "sweep_gamma.py"),
    "Sweep config file (configs/sweep_gamma.py[:quick]).")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/specjax_sweep", "Output folder.")
_RESUME = flags.DEFINE_bool("resume", False, "Skip points already in workdir/results.jsonl.")


def main(argv):
  del argv
  cfg, progress = _CONFIG.value, sys.stderr.isatty()
  if cfg.get("taskbench", ()):  # the task suite: one sweep per category + its report
    taskbench_run.run_taskbench(cfg, _WORKDIR.value, resume=_RESUME.value, progress=progress)
    summary = taskbench_run.REPORT
  else:
    sweep.run_sweep(cfg, _WORKDIR.value, resume=_RESUME.value, progress=progress)
    summary = "summary.md"
  with open(os.path.join(_WORKDIR.value, summary)) as f:
    print(f.read())
  print(f"outputs in {_WORKDIR.value}")


if __name__ == "__main__":
  cli.run(main)
