"""The cost surface T(B, N, context) of the target's verify and of one draft
step, in XLA and PyTorch on the same weights, with the bytes each step
reads, the fitted context model and the predicted batch where speculation's
speedup turns (specjax/bench/studies/cost_surface.py, cost_surface_report.py):

  python experiments/cost_surface.py --model=smollm2-135m --dtype=float32 \
      --contexts=512,2048,4096 --batches=1,4,8 --ns=1,5 \
      --drafter=streaming:256,4 --drafter=eagle:smollm2-eagle --workdir=/tmp/surface

Parity first (one line and exit 1 past the tolerance); a point that would
not fit the memory is refused in one line; an interrupted run resumes with
the same flags (other settings are refused). Writes results.jsonl,
settings.json, config.json, summary.md, crossover.json and surface.png.
"""

import os

from absl import flags

from specjax import cli
from specjax import workdir as wd
from specjax.bench import tables
from specjax.bench.backends import torch_llama
from specjax.bench.studies import cost_surface as cs
from specjax.bench.studies import cost_surface_report as report
from specjax.drafters import registry
from specjax.errors import ConfigError
from specjax.formats import checkpoint
from specjax.model import steps

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Target: preset, HF, GGUF or orbax.")
_MODEL_DRAFT = flags.DEFINE_string("model_draft", None, "Draft model of a `model` drafter.")
_DTYPE = flags.DEFINE_string("dtype", "float32", "Compute dtype.")
_CONTEXTS = flags.DEFINE_list("contexts", "512,2048,4096", "Tokens in each row's cache.")
_BATCHES = flags.DEFINE_list("batches", "1,4,8", "Batch sizes.")
_NS = flags.DEFINE_list("ns", "1,5", "Tokens per row of the target's forward (N).")
_DRAFTERS = flags.DEFINE_multi_string("drafter", ["streaming:256,4"],
                                      "A drafter whose step is timed (repeat the flag); "
                                      "+layerskip:K and :vocab=N ones with --engines=xla.")
_ENGINES = flags.DEFINE_list("engines", "xla,torch", "xla and/or torch.")
_GAMMA = flags.DEFINE_integer("gamma", 4, "Draft length of a proposal.", lower_bound=1)
_REPS = flags.DEFINE_integer("reps", 3, "Timed repetitions (alternating).", lower_bound=1)
_K = flags.DEFINE_integer("k", 4, "Steps per timed call.", lower_bound=1)
_COMPILE = flags.DEFINE_bool("torch_compile", False, "torch.compile the torch forward.")
_THREADS = flags.DEFINE_integer("torch_threads", 0, "torch's threads (0: its default).",
                                lower_bound=0)
_ALPHAS = flags.DEFINE_list("alphas", "0.6,0.8", "Acceptance rates of the predicted crossover.")
_PREDICT = flags.DEFINE_list("predict_batches", "1,2,3,4,6,8,12,16",
                             "Batches of the predicted speedup.")
_ATTENTION = flags.DEFINE_enum("attention", "auto", ["auto", "blocked", "masked"],
                               "XLA's attention kernel (ModelConfig.attention); auto: the "
                               "backend's.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where the records and report go.")


def main(argv):
  del argv
  if not _WORKDIR.value:
    raise ConfigError("--workdir is required")
  try:
    alphas = [float(a) for a in _ALPHAS.value]
  except ValueError:
    raise ConfigError(f"--alphas must be numbers, got {_ALPHAS.value}") from None
  if not all(0 <= a <= 1 for a in alphas):
    raise ConfigError(f"--alphas must lie in [0, 1], got {alphas}")
  s = cs.Settings(model=_MODEL.value, dtype=_DTYPE.value,
                  contexts=tuple(tables.parse_ints(_CONTEXTS.value, "--contexts", minimum=2)),
                  batches=tuple(tables.parse_ints(_BATCHES.value, "--batches")),
                  ns=tuple(tables.parse_ints(_NS.value, "--ns")),
                  drafters=tuple(registry.parse(d).spec for d in _DRAFTERS.value),
                  engines=tuple(_ENGINES.value), gamma=_GAMMA.value, reps=_REPS.value, k=_K.value,
                  torch_compile=_COMPILE.value, torch_threads=_THREADS.value,
                  model_draft=_MODEL_DRAFT.value, attention=_ATTENTION.value)
  predict = tables.parse_ints(_PREDICT.value, "--predict_batches")
  cfg, params, _ = checkpoint.load_model(s.model, dtype=s.dtype)
  if s.attention != "auto":
    cfg = cfg.replace(attention=s.attention)
  target, draft, tmodel, tdraft = steps.Runner(cfg, params), None, None, None
  if s.model_draft:
    dcfg, dparams, _ = checkpoint.load_model(s.model_draft, dtype=s.dtype, role="draft")
    dcfg = dcfg if s.attention == "auto" else dcfg.replace(attention=s.attention)
    draft = steps.Runner(dcfg, dparams)
  if "torch" in s.engines:
    kw = {"compile": s.torch_compile, "threads": s.torch_threads or None}
    tmodel = torch_llama.TorchLlama(cfg, params, **kw)
    if draft is not None:
      tdraft = torch_llama.TorchLlama(draft.cfg, draft.params, **kw)
  env = wd.environment()
  os.makedirs(_WORKDIR.value, exist_ok=True)
  print(f"target {cfg.name} ({cfg.precision}); {wd.machine_line(env)}")
  recs = cs.run(_WORKDIR.value, s, target, tmodel, draft, tdraft)
  wd.write_config(_WORKDIR.value, vars(s) | {"alphas": alphas, "predict_batches": predict}, env)
  dcfgs = {d: registry.parse(d).for_target(cfg).draft_config(cfg, draft and draft.cfg)
           for d in s.drafters}
  print(report.write(_WORKDIR.value, recs, cfg, dcfgs, s, alphas, predict, env))


if __name__ == "__main__":
  cli.run(main)
