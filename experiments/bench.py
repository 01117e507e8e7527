"""Prompt-processing and generation throughput, after llama.cpp's llama-bench.

  python experiments/bench.py --model=llama-160m,cpu-target,cpu-draft \
      --n_prompt=1,2,4,8,16 --n_gen=32 --reps=5

pp N is one forward_step over N new tokens against a cache that already
holds --n_depth tokens (the speculative verify shape); tg N is N successive
one-token decode steps from the same depth. Prints a markdown table (t/s as
mean ± std over --reps, ms per forward_step call as a median, compile seconds
kept out of every timing) and the verify-cost curve T(N)/T(1). Presets run
on random weights: speed does not depend on their values.
"""

from absl import flags

from specjax.bench.studies import llama_bench as bench
from specjax.bench import tables
from specjax import cli

_MODEL = flags.DEFINE_list("model", ["cpu-target"], "Models: preset names, HF or orbax directories.")
_DTYPE = flags.DEFINE_list("dtype", ["float32"], "Compute and parameter dtypes (float32, bfloat16, float16, bf16-mixed).")
_N_PROMPT = flags.DEFINE_list("n_prompt", ["1", "2", "4", "8", "16", "64"], "pp test sizes: tokens per forward_step call.")
_N_GEN = flags.DEFINE_integer("n_gen", 32, "tg test length: decode steps per repetition; 0 = no tg test.", lower_bound=0)
_N_DEPTH = flags.DEFINE_integer("n_depth", 128, "Tokens already in the KV cache before each test.", lower_bound=0)
_REPS = flags.DEFINE_integer("reps", 5, "Timed repetitions per test (after one untimed warm-up).", lower_bound=1)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of random weights (presets) and tokens.")
_OUT = cli.RecordFlags("test")


def main(argv):
  del argv
  n_prompt = tables.parse_ints(_N_PROMPT.value, "--n_prompt")

  # progress rows on stderr; the aligned table follows on stdout
  on_record = _OUT.on_record(lambda r: bench.bench_table([r]).splitlines()[-1])
  records = bench.run_bench(_MODEL.value, _DTYPE.value, n_prompt, _N_GEN.value,
                            _N_DEPTH.value, _REPS.value, _SEED.value, on_record=on_record)
  print(bench.bench_table(records))
  print()
  print(bench.BENCH_NOTES)
  print()
  print("Verify-cost curve (pp medians):")
  print(bench.verify_curve_table(records))
  _OUT.finish(records)


if __name__ == "__main__":
  cli.run(main)
