"""Speculative decoding, like llama.cpp's `speculative` example.

Built-in defaults (random weights at the CPU pair's real shapes, no download):
  python experiments/speculative.py --draft=4 --accept=bernoulli:0.8

The seed thread's experiments as settings:
  --accept=real              the real rule (greedy at --temp=0, exact sampling otherwise)
  --accept=bernoulli:0.8     accept each draft with probability 0.8 until the first miss
  --accept=fraction:0.8      accept the first 80% of every draft
  --accept=always            accept every draft
  --accept=mean_length:3     a per-token probability giving 3 accepted per step

Each run also times target-only generation on the same prompt and the same
cache capacity (--baseline), the two alternating over --reps repetitions, and
prints the median speedup. --draft is gamma, the draft length (llama.cpp's
name for the flag).
"""

import statistics

from absl import flags

from specjax import acceptance, checkpoint, cli, drafters, eagle, generation, schema, speculative
from specjax import steps, tokenizer
from specjax import workdir as wd

_MODEL = flags.DEFINE_string("model", "cpu-target", "Target: preset name, HF directory, orbax "
                             "directory or GGUF file.")
_MODEL_DRAFT = flags.DEFINE_string("model_draft", "cpu-draft", "Draft: preset name, HF directory, "
                                   "orbax directory or GGUF file.")
_N_PREDICT = flags.DEFINE_integer("n_predict", 128, "Tokens to generate.", lower_bound=1)
_DRAFT = flags.DEFINE_integer("draft", 5, "gamma, the draft length: tokens drafted per step "
                              "(llama.cpp's --draft).", lower_bound=1, upper_bound=64)
_ACCEPT = flags.DEFINE_string("accept", "real", "Acceptance rule: real | always | bernoulli:P | "
                              "fraction:F | mean_length:L")
_P_MIN = flags.DEFINE_float("p_min", 0.0, "Stop drafting when the draft's top probability is below this.",
                            lower_bound=0.0, upper_bound=1.0)
_GEN = cli.GenerationFlags("Sampling seed (random-init seed of presets: seed, seed+1).")
_DTYPE_DRAFT = flags.DEFINE_enum(
    "dtype_draft", None, ["float32", "bfloat16", "float16", "f32", "bf16", "f16", "bf16-mixed",
                          "int8"], "The draft's dtype (e.g. int8 for a cheap draft); default: --dtype.")
_CTX = flags.DEFINE_integer("ctx_size", None, "Context: the longest sequence (prompt + n_predict) "
                            "allowed, and the KV cache's size; default: what the run needs "
                            "(within the target's max_seq_len).", lower_bound=1)
_LOOP = flags.DEFINE_enum("loop", "device", ["device", "host"],
                          "device: one lax.while_loop; host: jitted phases timed one by one.")
_BASELINE = flags.DEFINE_bool("baseline", True, "Also time target-only generation and print the speedup.")
_REPS = flags.DEFINE_integer("reps", 3, "Timed repetitions; target-only and speculative alternate, "
                             "medians reported.", lower_bound=1)
_IGNORE_EOS = flags.DEFINE_bool("ignore_eos", True, "Do not stop at end-of-sequence (fixed-length runs).")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write tokens, statistics and timings as one JSON object.")
_DRAFTER = flags.DEFINE_string("drafter", "model", "What drafts (specjax/drafters.py): model "
                               "(--model_draft) | eagle (an EAGLE head, --eagle_head) | "
                               "ngram[:A-B] | layerskip:N | layerskip:LIST.")
_EAGLE_HEAD = flags.DEFINE_string("eagle_head", "stdlib-eagle", "The head of --drafter=eagle: a "
                                  "directory written by experiments/train_eagle.py, or "
                                  "stdlib-eagle (shipped, for --model=stdlib-target).")


def _drafter():
  """--drafter, with --eagle_head for a bare 'eagle'."""
  d = drafters.parse(_DRAFTER.value)
  if d.kind == "eagle" and ":" not in _DRAFTER.value:
    d = eagle.EagleDrafter(_EAGLE_HEAD.value)
  return d


def main(argv):
  del argv
  gamma = _DRAFT.value
  rule = acceptance.parse_rule(_ACCEPT.value).resolve(gamma)
  drafter = _drafter()
  tcfg, tparams, tok = checkpoint.load_model(_MODEL.value, dtype=_GEN.dtype, seed=_GEN.seed)
  if drafter.needs_draft_model:
    dcfg, dparams, dtok = checkpoint.load_model(_MODEL_DRAFT.value,
                                                dtype=_DTYPE_DRAFT.value or _GEN.dtype,
                                                seed=_GEN.seed + 1, role="draft")
    speculative.check_vocabularies(tcfg, dcfg)
    tokenizer.check_same_tokens(tok, dtok)
  else:  # the drafter runs from the target (and its own files)
    dcfg = drafter.draft_config(tcfg, None) or tcfg.replace(name=drafter.spec, n_layers=0)
    dparams = None
  prompt = _GEN.prompt(tok, tcfg.vocab_size)
  sp = _GEN.sampling()
  eos = None if _IGNORE_EOS.value else (tok.eos_id if tok else tcfg.eos_token_id)
  target = steps.Runner(tcfg, tparams)
  draft = steps.Runner(dcfg, dparams) if drafter.needs_draft_model else None
  # One capacity for both sides: attention cost grows with it.
  capacity = generation.plan_capacity(tcfg, len(prompt), _N_PREDICT.value, extra=gamma,
                                      ctx_size=_CTX.value)
  kw = dict(seed=_GEN.seed, eos_id=eos, loop=_LOOP.value, capacity=capacity)
  spec = lambda: speculative.generate(target, draft, [prompt], _N_PREDICT.value, gamma,
                                      sp=sp, rule=rule, p_min=_P_MIN.value,
                                      drafter=drafter, **kw)
  base = lambda: generation.generate(target, [prompt], _N_PREDICT.value, sp, **kw)
  compile_s = spec().compile_s + (base().compile_s if _BASELINE.value else 0.0)  # warm-up
  spec_tps, base_tps = [], []
  for _ in range(_REPS.value):  # alternating, so both sides see the same machine state
    if _BASELINE.value:
      b = base()
      base_tps.append(b.n_eval / b.eval_s)
    res = spec()
    spec_tps.append(res.stats.tokens_per_s)
  _report(tcfg, dcfg, tok, prompt, rule, res, b if _BASELINE.value else None,
          statistics.median(spec_tps), statistics.median(base_tps) if base_tps else None,
          capacity, compile_s)


def _report(tcfg, dcfg, tok, prompt, rule, res, base, spec_tps, base_tps, capacity, compile_s):
  st = res.stats
  print(cli.detokenize(tok, prompt) + cli.detokenize(tok, res.tokens[0]), flush=True)
  print()
  print(f"encoded {len(prompt):4d} tokens in {res.prompt_s:8.3f} seconds, speed: "
        f"{len(prompt) / res.prompt_s:9.3f} t/s")
  print(f"decoded {st.n_kept:4d} tokens in {res.eval_s:8.3f} seconds, speed: "
        f"{st.tokens_per_s:9.3f} t/s (last repetition)")
  print()
  print("\n".join(st.summary_lines()))
  print()
  print(f"target: {tcfg.name} ({tcfg.num_params() / 1e6:.1f} M params), draft: {dcfg.name} "
        f"({dcfg.num_params() / 1e6:.1f} M params; drafter {_drafter().spec}), "
        f"{tcfg.precision}, accept rule {rule}, "
        f"loop={_LOOP.value}, cache capacity {capacity}")
  print(f"{'compile time':>18} = {1e3 * compile_s:10.2f} ms (excluded from all timings)")
  sp = _GEN.sampling()
  out = schema.run_record(
      st, target=tcfg.name, draft=dcfg.name, precision=tcfg.precision, accept_rule=str(rule),
      temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, p_min=_P_MIN.value,
      seed=_GEN.seed, loop=_LOOP.value, capacity=capacity, reps=_REPS.value,
      prompt_tokens=prompt, tokens=res.tokens[0], spec_tps=spec_tps, prompt_s=res.prompt_s,
      compile_s=compile_s, env=wd.environment())
  print(f"{'speculative':>18} = {spec_tps:9.3f} tokens per second (median of {_REPS.value})")
  if base is not None:
    print(f"{'target-only':>18} = {base_tps:9.3f} tokens per second (median of {_REPS.value}, "
          f"alternating)")
    print(f"{'speedup':>18} = {spec_tps / base_tps:.3f}x (speculative t/s / target-only t/s)")
    out.update(baseline_tps=base_tps, speedup=spec_tps / base_tps, baseline_tokens=base.tokens[0])
  if _JSON_OUT.value:
    wd.write_json(_JSON_OUT.value, out)


if __name__ == "__main__":
  cli.run(main)
