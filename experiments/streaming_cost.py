"""The streaming draft's step against the target's decode step as the
context grows (specjax/bench/studies/streaming_cost.py):

  python experiments/streaming_cost.py --model=smollm2-135m --dtype=float32 \
      --drafter=streaming:256,4 --contexts=512,2048,4096 --batches=1,4

At each (context, batch) the target's cache holds `context` random tokens
per row; one draft step is the drafter's whole chain proposal / gamma, one
target step a T = 1 forward; medians of --reps alternating repetitions.
Prints T_draft(1), T_target(1) and c = T_draft(1) / T_target(1); --json_out
writes the records.
"""

from absl import flags

from specjax import cli
from specjax import workdir as wd
from specjax.bench import tables
from specjax.bench.studies import streaming_cost
from specjax.drafters import registry
from specjax.errors import ConfigError
from specjax.formats import checkpoint
from specjax.model import steps

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Target: preset, HF, GGUF or orbax.")
_DTYPE = flags.DEFINE_string("dtype", "float32", "Compute dtype.")
_DRAFTER = flags.DEFINE_string("drafter", "streaming:256,4", "A streaming drafter spec.")
_CONTEXTS = flags.DEFINE_list("contexts", "512,2048,4096", "Tokens in the caches.")
_BATCHES = flags.DEFINE_list("batches", "1,4", "Batch sizes.")
_GAMMA = flags.DEFINE_integer("gamma", 4, "Draft length of a proposal.", lower_bound=1)
_REPS = flags.DEFINE_integer("reps", 7, "Timed repetitions (alternating).", lower_bound=1)
_JSON = flags.DEFINE_string("json_out", None, "Write the records here (JSON).")


def main(argv):
  del argv
  if registry.parse(_DRAFTER.value).kind != "streaming":
    raise ConfigError(f"--drafter={_DRAFTER.value}: this study times a streaming drafter")
  contexts = tables.parse_ints(_CONTEXTS.value, "--contexts", minimum=2)
  batches = tables.parse_ints(_BATCHES.value, "--batches")
  cfg, params, _ = checkpoint.load_model(_MODEL.value, dtype=_DTYPE.value)
  print(f"target {cfg.name} ({cfg.precision}), drafter {_DRAFTER.value}, gamma {_GAMMA.value}, "
        f"medians of {_REPS.value}")
  recs = streaming_cost.streaming_cost(steps.Runner(cfg, params), _DRAFTER.value, contexts,
                                       batches, _GAMMA.value, _REPS.value)
  if _JSON.value:
    wd.write_json(_JSON.value, {"records": recs, "environment": wd.environment()})


if __name__ == "__main__":
  cli.run(main)
