"""What the speculative device loop costs beyond its own phases.

  python experiments/loop_overhead.py --model=cpu-target --model_draft=cpu-draft --gamma=4
  python experiments/loop_overhead.py --model=cpu-target --drafter=ngram --gamma=4

The device loop (one lax.while_loop: draft scan, verify, accept, and the
bookkeeping that keeps tokens, rolls the caches back and records statistics)
is timed per step with the rule `always` (every step after the first feeds
the draft its last token first: the catch-up), next to the same three phases
of such a step repeated in one jitted fori_loop with no bookkeeping. Both
alternate over --reps repetitions; medians. overhead = 1 - phases / loop: the
while loop, the bookkeeping, the records and the call itself.
"""

import numpy as np
from absl import flags

from specjax.formats import checkpoint
from specjax import cli
from specjax.bench.studies import loop_overhead
from specjax.decode import probes
from specjax.drafters import registry
from specjax.decode import plan
from specjax.model import steps

_MODEL = flags.DEFINE_string("model", "cpu-target", "Target: preset name, HF directory or orbax directory.")
_MODEL_DRAFT = flags.DEFINE_string("model_draft", "cpu-draft", "Draft: preset name, HF directory or "
                                   "orbax directory (--drafter=model only).")
_DRAFTER = cli.define_drafter_flag()
_DTYPE = flags.DEFINE_string("dtype", None, "Compute dtype of both (float32, bfloat16, bf16-mixed); default: the models' own.")
_GAMMA = flags.DEFINE_integer("gamma", 4, "Draft length.", lower_bound=1, upper_bound=64)
_N_STEPS = flags.DEFINE_integer("n_steps", 16, "Speculative steps per timed run.", lower_bound=2)
_N_PROMPT = flags.DEFINE_integer("n_prompt", 32, "Prompt tokens (random ids).", lower_bound=1)
_REPS = flags.DEFINE_integer("reps", 7, "Timed repetitions of each side (alternating).", lower_bound=1)
_SEED = flags.DEFINE_integer("seed", 0, "Random-init seed of presets (draft: seed + 1) and prompt.")
_OUT = cli.RecordFlags("measurement")


def main(argv):
  del argv
  drafter = registry.parse(_DRAFTER.value)
  tcfg, tparams, _ = checkpoint.load_model(_MODEL.value, dtype=_DTYPE.value, seed=_SEED.value)
  draft = None
  if drafter.needs_draft_model:
    dcfg, dparams, _ = checkpoint.load_model(_MODEL_DRAFT.value, dtype=_DTYPE.value,
                                             seed=_SEED.value + 1, role="draft")
    plan.check_vocabularies(tcfg, dcfg)
    draft = steps.Runner(dcfg, dparams)
  dname = draft.cfg.name if draft is not None else drafter.spec
  prompt = probes.random_tokens(np.random.RandomState(_SEED.value),
                               tcfg.vocab_size, 1, _N_PROMPT.value)[0].tolist()
  rec = loop_overhead.loop_overhead(steps.Runner(tcfg, tparams), draft, prompt,
                                    _GAMMA.value, _N_STEPS.value, _REPS.value, drafter=drafter)
  rec.update(target=tcfg.name, draft=dname, drafter=drafter.spec, precision=tcfg.precision,
             n_prompt=len(prompt))
  print(f"{tcfg.name} / {dname} ({tcfg.precision}), gamma {rec['gamma']}, "
        f"{rec['n_steps']} steps, medians of {_REPS.value}:")
  print(f"  device loop      {1e3 * rec['loop_step_s']:8.3f} ms/step")
  print(f"  its phases alone {1e3 * rec['phases_step_s']:8.3f} ms/step")
  print(f"  overhead         {100 * rec['overhead_share']:8.2f} % of the step")
  _OUT.finish([rec])


if __name__ == "__main__":
  cli.run(main)
