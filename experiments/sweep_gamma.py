"""The gamma x acceptance sweep: measured speedup next to the theory's.

  python experiments/sweep_gamma.py --config=configs/sweep_gamma.py:quick --workdir=/tmp/specjax_quick

Writes results.jsonl (one line per point, as it finishes), results.csv,
config.json, costs.json, speedup.png, verify_cost.png and summary.md into
--workdir. --resume skips the points already in results.jsonl.
"""

import os
import sys

from absl import flags
from ml_collections import config_flags

from specjax import cli
from specjax.bench import sweep

_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "..", "configs", "sweep_gamma.py"),
    "Sweep config file (configs/sweep_gamma.py[:quick]).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/specjax_sweep", "Output folder.")
_RESUME = flags.DEFINE_bool("resume", False, "Skip points already in workdir/results.jsonl.")


def main(argv):
  del argv
  sweep.run_sweep(_CONFIG.value, _WORKDIR.value, resume=_RESUME.value, progress=sys.stderr.isatty())
  with open(os.path.join(_WORKDIR.value, "summary.md")) as f:
    print(f.read())
  print(f"outputs in {_WORKDIR.value}")


if __name__ == "__main__":
  cli.run(main)
