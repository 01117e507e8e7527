"""Target-only generation, timed like llama.cpp's llama_print_timings.

Run on built-in defaults (random weights at the CPU target's real shape,
no download):
  python experiments/generate.py --model=cpu-target --n_predict=64

A real checkpoint (HF directory with config.json + safetensors, or an orbax
directory written by specjax) works the same way:
  python experiments/generate.py --model=/path/to/llama --prompt="Hello"

An Instruct model's prompt goes through its chat template with --chat (and
--system=TEXT; docs/models.md, Chat models).

Several prompts run as the rows of one batch (--prompt_file, one per line, or
a .jsonl file of prompts and, with --chat, conversations; --n_parallel repeats
each); --json_out keeps every row's prompt ids and tokens.
"""

from absl import flags

from specjax.formats import checkpoint
from specjax import cli
from specjax.decode import generation
from specjax.model import steps
from specjax import workdir as wd

_MODEL = flags.DEFINE_string("model", "cpu-target", "Preset name, HF directory or orbax directory.")
_N_PREDICT = flags.DEFINE_integer("n_predict", 64, "Tokens to generate.", lower_bound=1)
_GEN = cli.GenerationFlags()
_CTX = flags.DEFINE_integer("ctx_size", None, "Context: the longest sequence (prompt + n_predict) "
                            "allowed, and the KV cache's size; default: what the run needs "
                            "(within the model's max_seq_len).", lower_bound=1)
_LOOP = flags.DEFINE_enum("loop", "device", ["device", "host"], "Device while_loop or host loop of jitted steps.")
_WARMUP = flags.DEFINE_bool("warmup", True, "Run once untimed first so the timed run excludes compilation.")
_IGNORE_EOS = flags.DEFINE_bool("ignore_eos", False, "Do not stop at the end-of-sequence token.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write every row's prompt ids and tokens, text and "
                                "timings as one JSON object.")


def main(argv):
  del argv
  cfg, params, tok = checkpoint.load_model(_MODEL.value, dtype=_GEN.dtype, seed=_GEN.seed)
  prompts = _GEN.prompts(tok, cfg.vocab_size)
  sp = _GEN.sampling()
  eos = None if _IGNORE_EOS.value else (tok.eos_id if tok else cfg.eos_token_id)
  m = steps.Runner(cfg, params)
  run = lambda: generation.generate(m, prompts, _N_PREDICT.value, sp, seed=_GEN.seed,
                                    eos_id=eos, loop=_LOOP.value, ctx_size=_CTX.value)
  compile_s = run().compile_s if _WARMUP.value else 0.0
  res = run()
  compile_s += res.compile_s
  for p, out in zip(prompts, res.tokens):
    print(cli.detokenize(tok, p) + cli.detokenize(tok, out), flush=True)
    print()
  print(f"model: {cfg.name}, {cfg.num_params() / 1e6:.1f} M params, {cfg.precision}, "
        f"loop={_LOOP.value}" + (f", {len(prompts)} rows" if len(prompts) > 1 else ""))
  print(f"{'compile time':>18} = {1e3 * compile_s:10.2f} ms (excluded from the timings below)")
  print(cli.rate_line("prompt eval time", res.prompt_s, res.n_prompt, "tokens"))
  print(cli.rate_line("eval time", res.eval_s, res.n_eval, "runs"))
  if _JSON_OUT.value:
    wd.write_json(_JSON_OUT.value, {
        "model": cfg.name, "config": cfg.to_dict(),
        **({"prompt_tokens": prompts[0], "tokens": res.tokens[0],
            "text": cli.detokenize(tok, res.tokens[0]) if tok else None}
           if len(prompts) == 1 else {}),
        "batch": len(prompts), "rows": cli.row_records(prompts, res.tokens),
        "n_prompt": res.n_prompt, "n_eval": res.n_eval,
        "prompt_ms": 1e3 * res.prompt_s, "eval_ms": 1e3 * res.eval_s,
        "eval_ms_per_token": 1e3 * res.eval_s / max(res.n_eval, 1),
        "eval_tokens_per_s": (res.n_decoded / res.eval_s  # summed over rows, each to its EOS
                              if res.eval_s else None),
        "compile_ms": 1e3 * compile_s, "loop": _LOOP.value,
        "sampling": {"temperature": sp.temperature, "top_k": sp.top_k, "top_p": sp.top_p,
                     "seed": _GEN.seed},
        "env": wd.environment()})


if __name__ == "__main__":
  cli.run(main)
