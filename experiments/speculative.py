"""Speculative decoding, like llama.cpp's `speculative` example.

Built-in defaults (random weights at the CPU pair's real shapes, no download):
  python experiments/speculative.py --draft=4 --accept=bernoulli:0.8

The seed thread's experiments as settings:
  --accept=real              the real rule (greedy at --temp=0, exact sampling otherwise)
  --accept=bernoulli:0.8     accept each draft with probability 0.8 until the first miss
  --accept=fraction:0.8      accept the first 80% of every draft
  --accept=always            accept every draft
  --accept=mean_length:3     a per-token probability giving 3 accepted per step

Each run also times target-only generation on the same prompt (--baseline) and
prints the measured speedup.
"""

import dataclasses

from absl import flags

from specjax import acceptance, checkpoint, cli, generation, speculative, steps
from specjax.errors import ConfigError

_MODEL = flags.DEFINE_string("model", "cpu-target", "Target: preset name, HF directory or orbax directory.")
_MODEL_DRAFT = flags.DEFINE_string("model_draft", "cpu-draft", "Draft: preset name, HF directory or orbax directory.")
_N_PREDICT = flags.DEFINE_integer("n_predict", 128, "Tokens to generate.", lower_bound=1)
_DRAFT = flags.DEFINE_integer("draft", 5, "gamma: tokens drafted per step.", lower_bound=1, upper_bound=64)
_ACCEPT = flags.DEFINE_string("accept", "real", "real | always | bernoulli:P | fraction:F | mean_length:L")
_P_MIN = flags.DEFINE_float("p_min", 0.0, "Stop drafting when the draft's top probability is below this.",
                            lower_bound=0.0, upper_bound=1.0)
_GEN = cli.GenerationFlags("Sampling seed (random-init seed of presets: seed, seed+1).")
_CTX = flags.DEFINE_integer("ctx_size", None, "Context size; default: the target's max_seq_len.", lower_bound=1)
_LOOP = flags.DEFINE_enum("loop", "device", ["device", "host"],
                          "device: one lax.while_loop; host: jitted phases timed one by one.")
_BASELINE = flags.DEFINE_bool("baseline", True, "Also time target-only generation and print the speedup.")
_IGNORE_EOS = flags.DEFINE_bool("ignore_eos", True, "Do not stop at end-of-sequence (fixed-length runs).")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write tokens, statistics and timings as one JSON object.")


def main(argv):
  del argv
  rule = acceptance.parse_rule(_ACCEPT.value).resolve(_DRAFT.value)
  tcfg, tparams, tok = checkpoint.load_model(_MODEL.value, dtype=_GEN.dtype, seed=_GEN.seed)
  dcfg, dparams, dtok = checkpoint.load_model(_MODEL_DRAFT.value, dtype=_GEN.dtype, seed=_GEN.seed + 1)
  if tcfg.vocab_size != dcfg.vocab_size:
    raise ConfigError(f"draft and target vocabularies differ: {tcfg.vocab_size} (target "
                      f"{_MODEL.value}) vs {dcfg.vocab_size} (draft {_MODEL_DRAFT.value})")
  prompt = _GEN.prompt(tok, tcfg.vocab_size)
  sp = _GEN.sampling()
  eos = None if _IGNORE_EOS.value else (tok.eos_id if tok else tcfg.eos_token_id)
  target, draft = steps.Model(tcfg, tparams), steps.Model(dcfg, dparams)
  kw = dict(seed=_GEN.seed, eos_id=eos, loop=_LOOP.value, ctx_size=_CTX.value)
  spec = lambda: speculative.generate(target, draft, [prompt], _N_PREDICT.value, _DRAFT.value,
                                      sp=sp, rule=rule, p_min=_P_MIN.value, **kw)
  compile_s = spec().compile_s  # warm-up: compiles, untimed
  res = spec()
  base = None
  if _BASELINE.value:
    run_base = lambda: generation.generate(target, [prompt], _N_PREDICT.value, sp, **kw)
    compile_s += run_base().compile_s
    base = run_base()
  _report(tcfg, dcfg, tok, prompt, rule, res, base, compile_s)


def _report(tcfg, dcfg, tok, prompt, rule, res, base, compile_s):
  st = res.stats
  print(cli.detokenize(tok, prompt) + cli.detokenize(tok, res.tokens[0]), flush=True)
  print()
  n_dec = st.n_predict - 1  # the first token comes from the prompt evaluation
  print(f"encoded {len(prompt):4d} tokens in {res.prompt_s:8.3f} seconds, speed: "
        f"{len(prompt) / res.prompt_s:9.3f} t/s")
  print(f"decoded {n_dec:4d} tokens in {res.eval_s:8.3f} seconds, speed: "
        f"{st.tokens_per_s:9.3f} t/s")
  print()
  print("\n".join(st.summary_lines()))
  print()
  print(f"target: {tcfg.name} ({tcfg.num_params() / 1e6:.1f} M params), draft: {dcfg.name} "
        f"({dcfg.num_params() / 1e6:.1f} M params), {tcfg.dtype}, accept={rule}, loop={_LOOP.value}")
  print(f"{'compile time':>18} = {1e3 * compile_s:10.2f} ms (excluded from all timings)")
  out = {"target": tcfg.name, "draft": dcfg.name, "accept": str(rule), "loop": _LOOP.value,
         "prompt_tokens": prompt, "tokens": res.tokens[0], **st.to_dict(),
         "prompt_ms": 1e3 * res.prompt_s, "eval_ms": 1e3 * res.eval_s,
         "compile_ms": 1e3 * compile_s,
         "sampling": {**dataclasses.asdict(_GEN.sampling()), "seed": _GEN.seed}}
  if base is not None:
    base_tps = base.n_eval / base.eval_s
    print(cli.rate_line("target-only eval", base.eval_s, base.n_eval, "runs"))
    print(f"{'speedup':>18} = {st.tokens_per_s / base_tps:.3f}x (speculative t/s / target-only t/s)")
    out.update(baseline_tokens_per_s=base_tps, speedup=st.tokens_per_s / base_tps,
               baseline_tokens=base.tokens[0])
  if _JSON_OUT.value:
    cli.write_json(_JSON_OUT.value, out)


if __name__ == "__main__":
  cli.run(main)
