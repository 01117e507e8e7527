"""specjax speculative decoding against HF assisted generation, same weights.

  python experiments/compare_assisted.py --model=cpu-target --model_draft=cpu-draft \
      --gamma=4 --n_predict=64 --reps=3
  python experiments/compare_assisted.py --model=llama-160m --model_draft=llama-160m
  python experiments/compare_assisted.py --model=smollm2-135m --model_draft=smollm2-draft \
      --chat --prompt_file=PROMPTS.jsonl --hf_schedule=default \
      --specjax_gamma=auto:rows,max=4,budget=auto --noself_pair

Two pairs per run: the given (target, draft), and draft = target (the target's
own weights as draft: every draft accepted, which compares the two engines'
overheads; --noself_pair leaves it out). For each pair and engine:
target-only baseline and speculative (greedy; HF with a constant
num_assistant_tokens = gamma, or with --hf_schedule=default HF's own
schedule, what a user who sets nothing gets; specjax with --accept=real at
gamma, or --specjax_gamma, e.g. per-row lengths), all four token lists
compared exactly. --prompt_file: each prompt in turn, at batch 1. tokens/s = generated
tokens (the first, from the prompt evaluation, included) / wall time of the
whole generate call, prefill included; specjax's decode-only tokens/s is shown
too. --json_out keeps every number and, per (pair, engine), a row with the
prompt ids, the speculative tokens and the target-only tokens. Needs torch and
transformers.
"""

import os

from absl import flags

from specjax.bench.studies import assisted
from specjax.bench import tables
from specjax.formats import checkpoint
from specjax import cli
from specjax.decode import plan
from specjax.model import steps
from specjax.formats import tokenizer
from specjax import workdir as wd
from specjax.errors import ConfigError

_MODEL = flags.DEFINE_string("model", "cpu-target", "Target: preset name, HF directory, orbax directory or GGUF file.")
_MODEL_DRAFT = flags.DEFINE_string("model_draft", "cpu-draft", "Draft: preset name, HF directory, orbax directory or GGUF file.")
_GAMMA = flags.DEFINE_integer("gamma", 4, "Draft tokens per step (HF num_assistant_tokens, constant).",
                              lower_bound=1, upper_bound=64)
_N_PREDICT = flags.DEFINE_integer("n_predict", 64, "Tokens to generate (the first included).", lower_bound=1)
_PROMPT = cli.PromptFlags(file=True)  # --prompt(_file), --prompt_tokens, --chat, --system
_HF_SCHEDULE = flags.DEFINE_enum("hf_schedule", "constant", list(assisted.SCHEDULES),
                                 "HF's assistant: gamma tokens every step, or HF's default "
                                 "schedule (shrinks the draft after rejections).")
_SPECJAX_GAMMA = flags.DEFINE_string("specjax_gamma", None, "specjax's draft length when not "
                                     "--gamma: an integer, or auto:rows,max=G,budget=auto.")
_SELF_PAIR = flags.DEFINE_bool("self_pair", True, "Also run draft = target (the engines' "
                               "overheads, every draft accepted).")
_REPS = flags.DEFINE_integer("reps", 3, "Timed repetitions of each generate call (after one warm-up).",
                             lower_bound=1)
_DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "bfloat16", "float16", "f32", "bf16", "f16"],
                           "Dtype of both models, both engines; default: their own.")
_THREADS = flags.DEFINE_integer("threads", 2, "torch intra-op threads (JAX uses every core).",
                                lower_bound=1)
_HF_ATTN = flags.DEFINE_enum("hf_attn", "sdpa", ["sdpa", "eager"], "HF attention implementation.")
_SEED = flags.DEFINE_integer("seed", 0, "Random-init seed of presets: target seed, draft seed+1.")
_JSON_OUT = flags.DEFINE_string("json_out", None,
                                "Write every number, token list and the environment as JSON.")


def _torch():
  try:
    import torch  # pylint: disable=import-outside-toplevel
    import transformers  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ConfigError(f"this comparison needs torch and transformers ({e}); "
                      f"pip install torch==2.13.0 transformers") from None
  transformers.logging.set_verbosity_error()  # HF's per-call deprecation notices
  return torch


def main(argv):
  del argv
  torch = _torch()
  torch.set_num_threads(_THREADS.value)
  tcfg, tparams, tok = checkpoint.load_model(_MODEL.value, dtype=_DTYPE.value, seed=_SEED.value)
  dcfg, dparams, dtok = checkpoint.load_model(_MODEL_DRAFT.value, dtype=_DTYPE.value, seed=_SEED.value + 1,
                                              role="draft")
  plan.check_vocabularies(tcfg, dcfg)
  tokenizer.check_same_tokens(tok, dtok)
  prompts = _PROMPT.prompts(tok, tcfg.vocab_size)
  sj_gamma = None if _SPECJAX_GAMMA.value is None else cli.parse_gamma(_SPECJAX_GAMMA.value)
  if sj_gamma == cli.AUTO:
    raise ConfigError("--specjax_gamma: an integer or auto:rows,max=G,budget=auto")
  target, draft = steps.Runner(tcfg, tparams), steps.Runner(dcfg, dparams)
  pt_target, pt_draft = assisted.torch_models(target, draft, _HF_ATTN.value)
  pairs = [(f"{_MODEL.value} / {_MODEL_DRAFT.value}", draft, pt_draft)]
  if _SELF_PAIR.value:
    pt_self = assisted.torch_models(target, target, _HF_ATTN.value)[1]
    pairs.append((f"{_MODEL.value} / itself (draft = target)", target, pt_self))
  env = {**wd.environment(), "torch": torch.__version__,
         "transformers": __import__("transformers").__version__,
         "torch_threads": torch.get_num_threads()}
  results, loads = [], []
  for i, prompt in enumerate(prompts):
    for label, d, pt_d in pairs:
      label = label if len(prompts) == 1 else f"prompt {i}: {label}"
      results.append(assisted.compare(target, d, prompt, _N_PREDICT.value, _GAMMA.value,
                                      _REPS.value, label, (pt_target, pt_d),
                                      hf_schedule=_HF_SCHEDULE.value, specjax_gamma=sj_gamma))
      loads.append(os.getloadavg()[0])
  _report(results, env, loads, prompts)


def _report(results, env, loads, prompts):
  print(tables.markdown_table(assisted.TABLE_COLUMNS, assisted.table_rows(results),
                             right=[False, False] + [True] * 4 + [False, True, True]))
  print()
  print(f"tokens/s = {_N_PREDICT.value} generated tokens (the first, from the prompt, included) / "
        f"median wall time of the whole generate call ({_REPS.value} reps, prefill included); "
        f"decode-only = specjax's (n_predict - 1) / eval_s, prefill excluded. "
        f"speedup = speculative t/s / same-engine baseline t/s. accept rate = n_accept / n_drafted.")
  print(f"prompts {', '.join(str(len(p)) for p in prompts)} tokens; HF: "
        + (f"gamma {_GAMMA.value} every step" if _HF_SCHEDULE.value == "constant"
           else "its default schedule")
        + f"; specjax: {_SPECJAX_GAMMA.value or f'gamma {_GAMMA.value}'}; "
        f"{results[0].capacity} specjax cache "
        f"slots; torch {env['torch']} ({env['torch_threads']} threads, attn "
        f"{results[0].hf_attn}), transformers {env['transformers']}, jax {env['jax']} "
        f"({env['backend']}, {env['cpu_count']} cores); 1-min load after each pair: "
        + ", ".join(f"{l:.2f}" for l in loads))
  print(f"machine: {wd.machine_line(env)}")
  for r in results:
    sj = r.engines["specjax"].decode
    print(f"[{r.pair}] specjax compile (excluded): baseline {sj['baseline_compile_s']:.2f} s, "
          f"speculative {sj['spec_compile_s']:.2f} s")
    for key, d in r.divergences.items():
      print(f"[{r.pair}] {key}: {'identical' if d is None else d}")
  g = None
  if _SELF_PAIR.value:
    g = assisted.goal(results[-1])
    print(f"performance goal (draft = target, gamma {g['gamma']}): specjax speedup "
          f"{g['specjax_speedup']:.3f}x {'>=' if g['holds'] else '<'} HF speedup "
          f"{g['hf_speedup']:.3f}x: {'holds' if g['holds'] else 'FAILS'}")
  if _JSON_OUT.value:
    wd.write_json(_JSON_OUT.value, {
        "flags": {"model": _MODEL.value, "model_draft": _MODEL_DRAFT.value, "gamma": _GAMMA.value,
                  "hf_schedule": _HF_SCHEDULE.value, "specjax_gamma": _SPECJAX_GAMMA.value,
                  "self_pair": _SELF_PAIR.value,
                  "n_predict": _N_PREDICT.value, "reps": _REPS.value, "dtype": _DTYPE.value,
                  "threads": _THREADS.value, "hf_attn": _HF_ATTN.value, "seed": _SEED.value},
        "environment": env, "load_avg_1m_after_each_pair": loads,
        "pairs": [r.to_dict() for r in results], "goal": g,
        "rows": [{"pair": r.pair, "engine": name, **cli.row_records(
            [r.prompt], [e.spec_tokens], [e.baseline_tokens])[0]}
                 for r in results for name, e in r.engines.items()]})


if __name__ == "__main__":
  cli.run(main)
