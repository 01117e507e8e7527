"""Batch scaling, XLA vs PyTorch vs llama.cpp: T(N), T(N)/T(1) and tokens/s.

  python experiments/batch_scaling.py --config=configs/batch_scaling.py:quick --workdir=/tmp/specjax_scaling_quick

Same model, same weights (converted from the specjax params; a GGUF model
file is run by llama.cpp as it is), same dtype and thread count, same
machine, one run; a parity check of the logits first.
Writes results.jsonl, results.csv, config.json, parity.json, scaling.png,
decode.png and summary.md into --workdir, and prints the summary.
"""

import os

from absl import flags

from specjax.bench.studies import batch_scaling
from specjax import cli

_CONFIG = cli.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "..", "configs", "batch_scaling.py"),
    "Comparison config file (configs/batch_scaling.py[:quick|tiny|gpu]).")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/specjax_scaling", "Output folder.")


def main(argv):
  del argv
  batch_scaling.run_batch_scaling(_CONFIG.value, _WORKDIR.value)
  with open(os.path.join(_WORKDIR.value, "summary.md")) as f:
    print(f.read())
  print(f"outputs in {_WORKDIR.value}")


if __name__ == "__main__":
  cli.run(main)
