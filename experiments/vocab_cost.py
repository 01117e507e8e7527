"""The cost of one draft step against the draft vocabulary's size
(specjax/bench/studies/vocab_cost.py):

  python experiments/vocab_cost.py --model=smollm2-135m --dtype=float32 \
      --drafters=eagle:smollm2-eagle,model --model_draft=smollm2-draft

Each drafter runs over the full vocabulary and over the top V_d ids of the
target's shipped ranking (--sizes; a drafter spec's :vocab=N), next to the
target's decode step; medians of --reps alternating repetitions. Prints
T_draft(1), c = T_draft(1) / T_target(1) and the held-out coverage stored
with the ranking; --json_out writes the records, --plot c against V_d.
"""

from absl import flags

from specjax import cli
from specjax.bench.studies import vocab_cost
from specjax.drafters import registry
from specjax.drafters import vocab
from specjax.errors import ConfigError
from specjax.formats import checkpoint
from specjax.model import steps
from specjax import workdir as wd

_MODEL = flags.DEFINE_string("model", "smollm2-135m", "Target: preset, HF, GGUF or orbax.")
_MODEL_DRAFT = flags.DEFINE_string("model_draft", "smollm2-draft", "Draft of the model drafter.")
_DTYPE = flags.DEFINE_string("dtype", "float32", "Compute dtype of both.")
_DRAFTERS = flags.DEFINE_list("drafters", "eagle,model", "Network drafter specs.")
_SIZES = flags.DEFINE_list("sizes", "full,32768,16384,8192,4096", "V_d values: full or N.")
_GAMMA = flags.DEFINE_integer("gamma", 4, "Draft length of a proposal.", lower_bound=1)
_DEPTH = flags.DEFINE_integer("depth", 256, "Tokens in the caches.", lower_bound=2)
_REPS = flags.DEFINE_integer("reps", 9, "Timed repetitions (alternating).", lower_bound=1)
_JSON = flags.DEFINE_string("json_out", None, "Write the records here (JSON).")
_PLOT = flags.DEFINE_string("plot", None, "Write c against V_d here (PNG).")


def main(argv):
  del argv
  for size in _SIZES.value:
    if size != "full" and not (size.isdigit() and int(size) > 0):
      raise ConfigError(f"--sizes: {size!r} is neither full nor a positive integer")
  specs = [registry.parse(s).spec for s in _DRAFTERS.value]
  tcfg, tparams, _ = checkpoint.load_model(_MODEL.value, dtype=_DTYPE.value)
  target = steps.Runner(tcfg, tparams)
  draft = None
  if any(registry.parse(s).needs_draft_model for s in specs):
    dcfg, dparams, _ = checkpoint.load_model(_MODEL_DRAFT.value, dtype=_DTYPE.value, role="draft")
    draft = steps.Runner(dcfg, dparams)
  recs = vocab_cost.vocab_cost(target, draft, specs, _SIZES.value, _GAMMA.value,
                               _DEPTH.value + 4 * _GAMMA.value + 8, _DEPTH.value, _REPS.value)
  cover = {}
  for path in vocab.SHIPPED_VOCAB.values():
    f = path / vocab.VOCAB_FILE
    if f.is_file() and wd.read_json(f).get("vocab_size") == tcfg.vocab_size:
      cover = wd.read_json(f).get("coverage", {})
  print(f"target {tcfg.name} ({tcfg.precision}): T(1) {1e3 * recs[0]['t_target_s']:.2f} ms, "
        f"medians of {_REPS.value}")
  print(f"{'drafter':<28} {'V_d':>7} {'T_draft(1) ms':>14} {'c':>7} {'spread':>7} {'coverage':>9}")
  for r in recs:
    r["coverage"] = cover.get(r["vocab"])
    cov = "" if r["coverage"] is None else f"{r['coverage']:.4f}"
    print(f"{r['drafter']:<28} {r['vocab']:>7} {1e3 * r['t_draft_s']:>14.3f} {r['c']:>7.3f} "
          f"{100 * r['spread']:>6.1f}% {cov:>9}")
  if _PLOT.value:
    vocab_cost.plot(recs, tcfg.vocab_size, _PLOT.value)
  if _JSON.value:
    wd.write_json(_JSON.value, {"records": recs, "model": _MODEL.value, "dtype": _DTYPE.value})


if __name__ == "__main__":
  cli.run(main)
