"""Real acceptance of drafters on the self-distillation mix's held-out
prompts (the training pipeline's alpha, for any drafter spec):

  python experiments/heldout_alpha.py --drafters=eagle:smollm2-eagle,model --temps=0,1

The prompts are the first --n_prompts held-out records of the mix that
configs/train.py names (its target, counts, seed and split), rendered
through the target's chat template; each drafter runs gamma --gamma,
--n_predict tokens, up to EOS, on the engine (real acceptance). Prints
alpha and tokens per step per drafter and temperature; --json_out keeps them.
"""

import os

from absl import flags

from specjax import cli
from specjax import workdir as wd
from specjax.decode import speculative
from specjax.drafters import registry
from specjax.errors import ConfigError
from specjax.formats import checkpoint
from specjax.model import steps
from specjax.model.sampling import SamplingParams
from specjax.train import replies

_CONFIG = cli.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "..", "configs", "train.py") + ":smollm2",
    "The self-distillation config whose target and held-out prompts are used.")
_DRAFTERS = flags.DEFINE_list("drafters", "eagle:smollm2-eagle", "Drafter specs.")
_MODEL_DRAFT = flags.DEFINE_string("model_draft", "smollm2-draft", "Draft of the model drafter.")
_N = flags.DEFINE_integer("n_prompts", 24, "Held-out prompts.", lower_bound=1)
_GAMMA = flags.DEFINE_integer("gamma", 4, "Draft length.", lower_bound=1)
_N_PREDICT = flags.DEFINE_integer("n_predict", 96, "Tokens per prompt (up to EOS).",
                                  lower_bound=1)
_TEMPS = flags.DEFINE_list("temps", "0,1", "Sampling temperatures.")
_JSON = flags.DEFINE_string("json_out", None, "Write the records here (JSON).")


def main(argv):
  del argv
  try:
    temps = [float(t) for t in _TEMPS.value]
  except ValueError:
    raise ConfigError(f"--temps: expected numbers, got {_TEMPS.value}") from None
  drafters = [registry.parse(s) for s in _DRAFTERS.value]
  c = _CONFIG.value
  tcfg, tparams, tok = checkpoint.load_model(str(c.target), dtype="float32")
  if tok is None or tok.chat is None:
    raise ConfigError(f"target {c.target}: the held-out prompts need its chat template")
  target = steps.Runner(tcfg, tparams)
  draft = None
  if any(d.needs_draft_model for d in drafters):
    dcfg, dparams, _ = checkpoint.load_model(_MODEL_DRAFT.value, dtype="float32", role="draft")
    draft = steps.Runner(dcfg, dparams)
  mix = replies.prompt_mix(dict(c.mix), int(c.seed), int(c.heldout_every), int(c.max_files))
  held = [r for r in mix if r["heldout"]][:_N.value]
  prompts = [tok.encode_chat(r["messages"]) for r in held]
  recs = []
  for d in drafters:
    for t in temps:
      s = speculative.generate(target, draft, prompts, _N_PREDICT.value, _GAMMA.value,
                               sp=SamplingParams(t), eos_id=tok.eos_id, drafter=d).stats
      recs.append({"drafter": d.spec, "temp": t, "alpha": s.alpha,
                   "tokens_per_step": s.tokens_per_step, "alpha_at_pos": s.alpha_at_pos,
                   "n_steps": s.n_steps})
      print(f"{d.spec:<36} T={t:g}: alpha {s.alpha:.3f}, tokens/step {s.tokens_per_step:.2f} "
            f"({len(prompts)} held-out prompts, gamma {_GAMMA.value}, mix v{replies.MIX_VERSION})",
            flush=True)
  if _JSON.value:
    wd.write_json(_JSON.value, {"records": recs, "prompts": len(prompts),
                                "mix_version": replies.MIX_VERSION, "gamma": _GAMMA.value,
                                "n_predict": _N_PREDICT.value})


if __name__ == "__main__":
  cli.run(main)
