"""Batched speculative decoding, PyTorch vs specjax (XLA), on the same weights.

  python experiments/torch_spec_bench.py --batch=1,2,4,8 --gamma=1,2,4,auto       --rules=bernoulli:0.8,always --n_predict=32 --jsonl_out=/tmp/ts.jsonl

For every (B, gamma, rule) each engine runs target-only and speculative
greedy generation for B ragged prompts, the two alternating over --reps
after an untimed warm-up; the speedup is the median of each repetition's
ratio (gamma.run_group's pairing).
  torch    backends/torch_spec.TorchSpec: a host loop of torch.compile'd
           forwards (T = 1 decode and draft, T = gamma + 1 verify).
  specjax  speculative.generate / generation.generate (device loops).
--costs adds T(B, N) for N = 1 and every gamma + 1. With auto among the
gammas (specjax), the chooser's costs are measured first
(autogamma.measure_costs) and a point with gamma chosen at run time
(decode/adaptive.py's loop; --auto_calibrate times each gamma's step first) follows
each rule's fixed gammas, timed with the same pairing. With --out_dir:
summary.md (speedups, the crossover batch per engine, rule and gamma, auto
against the best fixed gamma, the cost surfaces), speedup_vs_batch.png and
verify_surface_<engine>.png, rewritten after every batch. Every point record
keeps its rows' tokens. How it measures (threads, the simulated rules'
draws) and the figures: docs/batches.md. The runner and the report:
specjax.bench.studies.torch_study.
"""

from absl import flags

from specjax import cli
from specjax.bench.studies import torch_study
from specjax.decode import autogamma
from specjax.errors import ConfigError

_MODEL = flags.DEFINE_string("model", "cpu-target", "Target: preset, HF or orbax directory.")
_MODEL_DRAFT = flags.DEFINE_string("model_draft", "cpu-draft", "Draft: preset, HF or orbax directory.")
_DTYPE = flags.DEFINE_string("dtype", "float32", "Compute and parameter dtype.")
_BATCH = flags.DEFINE_list("batch", ["1", "2", "4", "8"], "Batch sizes B.")
_GAMMA = flags.DEFINE_list("gamma", ["1", "2", "4", "auto"], "Draft lengths gamma; 'auto' "
                           "(specjax): also gamma chosen at run time from the others.")
_RULES = flags.DEFINE_list("rules", ["bernoulli:0.8", "always"], "Acceptance rules.")
_N_PREDICT = flags.DEFINE_integer("n_predict", 32, "Tokens per row (first included).", lower_bound=1)
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 16, "Longest prompt; rows are ragged.", lower_bound=7)
_REPS = flags.DEFINE_integer("reps", 3, "Timed repetitions (alternating).", lower_bound=1)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of weights, prompts and acceptance draws.")
_ENGINES = flags.DEFINE_list("engines", ["torch", "specjax"], "torch and/or specjax.")
_COMPILE = flags.DEFINE_bool("compile", True, "torch.compile the torch forwards (else eager).")
_THREADS = flags.DEFINE_integer("threads", 0, "torch threads (0: every core, as XLA).")
_COSTS = flags.DEFINE_bool("costs", True, "Also measure T(B, N), N = 1 and gamma + 1.")
_K = flags.DEFINE_integer("k", 4, "Forwards per cost repetition.", lower_bound=1)
_AUTO_EVERY = flags.DEFINE_integer("auto_every", autogamma.EVERY,
                                   "Steps between auto gamma choices (once warmed in).",
                                   lower_bound=1)
_CALIBRATE = flags.DEFINE_bool("auto_calibrate", True, "Auto gamma: time each gamma's loop "
                                "step after the warm-up (autogamma.calibrate) before choosing.")
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Write summary.md and the plots here.")
_OUT = cli.RecordFlags("point")


def main(argv):
  del argv
  gammas, auto = cli.parse_gammas(_GAMMA.value)
  if not gammas:
    raise ConfigError("--gamma=auto chooses among fixed gammas: give some, e.g. --gamma=1,2,4,auto")
  try:
    batches = [int(x) for x in _BATCH.value]
  except ValueError:
    raise ConfigError(f"--batch must be integers, got {_BATCH.value}") from None
  settings = torch_study.Settings(
      model=_MODEL.value, model_draft=_MODEL_DRAFT.value, dtype=_DTYPE.value, batches=batches,
      gammas=gammas, auto=auto, rules=tuple(_RULES.value), n_predict=_N_PREDICT.value,
      prompt_len=_PROMPT_LEN.value, reps=_REPS.value, seed=_SEED.value,
      engines=tuple(_ENGINES.value), compile=_COMPILE.value, threads=_THREADS.value,
      costs=_COSTS.value, k=_K.value, auto_every=_AUTO_EVERY.value,
      calibrate=_CALIBRATE.value, out_dir=_OUT_DIR.value)
  records = torch_study.run(settings, _OUT.on_record(torch_study.progress_row))
  print(torch_study.table(records))
  _OUT.finish(records)


if __name__ == "__main__":
  cli.run(main)
