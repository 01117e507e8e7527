"""Decode cost against the cache capacity and the used length.

  python experiments/attention_bench.py --model=llama-160m --capacities=256,4096 --depths=128,2048

For every capacity and every depth that fits (depth + n_gen <= capacity):
decode ms/token (batch 1, n_gen steps from a cache holding `depth` tokens)
with the model's blocked attention (cost follows the used length) next to one
masked pass over the whole capacity (attn_block 0), alternating, medians of
--reps. The goals: at 128 used, capacity 4096 within 1.1x of capacity 256
(blocked); the growth from 128 to 2048 used is the attention's own cost.
"""

from absl import flags

from specjax.bench.studies import llama_bench as bench
from specjax.bench import tables
from specjax.formats import checkpoint
from specjax import cli
from specjax.model import steps
from specjax.errors import ConfigError

_MODEL = flags.DEFINE_list("model", ["llama-160m"], "Models: preset names, HF or orbax directories.")
_DTYPE = flags.DEFINE_string("dtype", None, "Compute dtype (float32, bfloat16, bf16-mixed); default: the model's own.")
_CAPACITIES = flags.DEFINE_list("capacities", ["256", "4096"], "Cache capacities (slots).")
_DEPTHS = flags.DEFINE_list("depths", ["128", "2048"], "Tokens in the cache before the timed steps.")
_N_GEN = flags.DEFINE_integer("n_gen", 16, "Decode steps per repetition.", lower_bound=1)
_REPS = flags.DEFINE_integer("reps", 5, "Timed repetitions per point and variant.", lower_bound=1)
_MASKED = flags.DEFINE_bool("masked", True, "Also time one masked pass over the capacity.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of random weights (presets) and tokens.")
_OUT = cli.RecordFlags("(model, capacity, depth, variant)")


def main(argv):
  del argv
  caps, depths = tables.parse_ints(_CAPACITIES.value), tables.parse_ints(_DEPTHS.value)
  points = [(c, d) for c in caps for d in depths if d + _N_GEN.value <= c]
  if not points:
    raise ConfigError(f"no depth + n_gen fits any capacity ({caps}, {depths}, n_gen {_N_GEN.value})")
  records = []
  on_record = _OUT.on_record(lambda r: f"{r['model']} capacity {r['capacity']} depth "
                             f"{r['n_depth']} {r['variant']}: {r['ms_per_token']:.2f} ms/token")
  for spec in _MODEL.value:
    cfg, params, _ = checkpoint.load_model(spec, dtype=_DTYPE.value, seed=_SEED.value)
    # A capacity past max_seq_len only adds unused slots; a depth past it is refused.
    fit = [(c, d) for c, d in points if d + _N_GEN.value <= cfg.max_seq_len]
    if len(fit) < len(points):
      print(f"{cfg.name}: leaving out depths past max_seq_len {cfg.max_seq_len}: "
            f"{sorted({d for c, d in points if (c, d) not in fit})}")
    if not fit:
      raise ConfigError(f"{cfg.name}: no depth + n_gen fits max_seq_len {cfg.max_seq_len}")
    rs = bench.attention_scaling(steps.Runner(cfg, params), fit, _N_GEN.value, _REPS.value,
                                 _SEED.value, _MASKED.value, on_record)
    print(f"\n{cfg.name} ({cfg.precision}), attention blocks of {cfg.attn_block} slots:")
    print(bench.attention_table(rs))
    records += rs
  _OUT.finish(records)


if __name__ == "__main__":
  cli.run(main)
