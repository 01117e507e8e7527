"""Layer loop: specjax's unrolled layers vs a lax.scan over stacked weights.

  python experiments/layer_loop_bench.py --model=llama-160m --capacity=256

On --model (real weights, random for presets) both variants decode one token
against a cache of --capacity slots holding --depth tokens: compile seconds
(lowering + XLA compile, ahead of time) and median ms per decode step. The
logits of the two are compared, as a check of the comparison itself. Then, for
each of --compile_only (default llama-2-70b, 80 layers), the same T=1 decode
is lowered and compiled at full size from ShapeDtypeStructs: nothing is
allocated, nothing runs; only compile seconds are reported.
"""

from absl import flags

from specjax import cli
from specjax.bench.studies import layer_loop

_MODEL = flags.DEFINE_string("model", "llama-160m", "Model whose decode is timed: preset, HF or orbax directory.")
_DTYPE = flags.DEFINE_string("dtype", "float32", "Compute and parameter dtype.")
_CAPACITY = flags.DEFINE_integer("capacity", 256, "KV cache capacity (slots).", lower_bound=2)
_DEPTH = flags.DEFINE_integer("depth", 128, "Tokens in the cache before each timed decode step.", lower_bound=0)
_REPS = flags.DEFINE_integer("reps", 20, "Timed decode steps per variant (after two untimed ones).", lower_bound=1)
_COMPILE_ONLY = flags.DEFINE_list("compile_only", ["llama-2-70b"], "Presets compiled at full size, never run.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of random weights (presets) and tokens.")
_OUT = cli.RecordFlags("(model, variant)")


def main(argv):
  del argv

  on_record = _OUT.on_record(lambda r: layer_loop.layer_loop_table([r]).splitlines()[-1])
  records = layer_loop.run_layer_loop_bench(_MODEL.value, _DTYPE.value, _CAPACITY.value, _DEPTH.value,
                                       _REPS.value, _COMPILE_ONLY.value, _SEED.value,
                                       on_record=on_record)
  print(layer_loop.layer_loop_table(records))
  print()
  print("compile s: wall time of jit(...).lower(...).compile() (trace + lower + XLA compile). "
        "decode ms/step: median ± std of single T=1 steps, batch 1, compile excluded.")
  _OUT.finish(records)


if __name__ == "__main__":
  cli.run(main)
