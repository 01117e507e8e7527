"""Batched decoding throughput, after llama.cpp's llama-batched-bench.

  python experiments/batched_bench.py --model=cpu-target --batch=1,2,4,8 --pp=128 --tg=32

For every (PP, TG, B): B rows of PP prompt tokens in one prefill call (T_PP),
then TG decode steps of B tokens each (T_TG), both medians of --reps timed
repetitions with compile time excluded. Columns as llama.cpp defines them:
N_KV = B*(PP+TG), S_PP = B*PP/T_PP, S_TG = B*TG/T_TG, T = T_PP+T_TG, S = N_KV/T.
"""

from absl import flags

from specjax.bench.studies import llama_bench as bench
from specjax.bench import tables
from specjax.formats import checkpoint
from specjax import cli
from specjax.model import config
from specjax.model import steps

_MODEL = flags.DEFINE_string("model", "cpu-target", "Preset name, HF directory or orbax directory.")
_DTYPE = flags.DEFINE_string("dtype", "float32", "Compute and parameter dtype (float32, bfloat16, float16).")
_BATCH = flags.DEFINE_list("batch", ["1", "2", "4", "8"], "Batch sizes B (parallel sequences).")
_PP = flags.DEFINE_list("pp", ["128"], "Prompt lengths PP per sequence.")
_TG = flags.DEFINE_list("tg", ["32"], "Generated tokens TG per sequence.")
_REPS = flags.DEFINE_integer("reps", 3, "Timed repetitions of each phase (after one untimed warm-up).", lower_bound=1)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of random weights (presets) and tokens.")
_OUT = cli.RecordFlags("(PP, TG, B)")


def main(argv):
  del argv
  batches = tables.parse_ints(_BATCH.value, "--batch")
  pps, tgs = tables.parse_ints(_PP.value, "--pp"), tables.parse_ints(_TG.value, "--tg")
  cfg, params, _ = checkpoint.load_model(_MODEL.value, dtype=config.canonical_precision(_DTYPE.value),
                                         seed=_SEED.value)

  on_record = _OUT.on_record(lambda r: bench.batched_table([r]).splitlines()[-1])
  records = bench.run_batched_bench(steps.Runner(cfg, params), batches, pps, tgs, _REPS.value,
                                    _SEED.value, on_record=on_record)
  print(f"model: {cfg.name}, {tables.format_params(records[0]['n_params'])} params, "
        f"{tables.format_size(records[0]['size_bytes'])}, {cfg.precision}, backend {records[0]['backend']}, "
        f"KV capacity {records[0]['capacity']}, T_PP/T_TG medians of {_REPS.value} reps")
  print()
  print(bench.batched_table(records))
  _OUT.finish(records)


if __name__ == "__main__":
  cli.run(main)
