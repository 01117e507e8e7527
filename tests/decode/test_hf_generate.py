"""Greedy generation (target-only and speculative) equals HF's on the same weights."""

import pytest

from specjax.decode import generation
from specjax.formats import hf
from specjax.decode import speculative
from specjax.model import steps

torch = pytest.importorskip("torch", reason="needs torch (pip install -e '.[test]')")
transformers = pytest.importorskip("transformers", reason="needs transformers")

BASE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=128, max_position_embeddings=128,
            rms_norm_eps=1e-5)


def _hf_model(seed):
  torch.manual_seed(seed)
  cfg = transformers.LlamaConfig(**BASE, attn_implementation="eager")
  model = transformers.LlamaForCausalLM(cfg).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.normal_(0.0, 0.15)
  return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  out = []
  for seed in (0, 1):
    path = tmp_path_factory.mktemp(f"hf{seed}")
    _hf_model(seed).save_pretrained(path)
    cfg, params = hf.load_hf(path)
    out.append((_hf_model(seed), steps.Runner(cfg, params)))
  return out


def _hf_greedy(model, prompt, n, **kw):
  ids = torch.tensor([prompt])
  with torch.no_grad():
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         pad_token_id=0, eos_token_id=None, **kw)
  return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("prompt", [[1, 5, 9, 200, 3], [42] * 7])
def test_greedy_generation_equals_hf_generate(models, prompt):
  (hf_target, target), _ = models
  want = _hf_greedy(hf_target, prompt, 24)
  for loop in ("device", "host"):
    assert generation.generate(target, [prompt], 24, loop=loop).tokens[0] == want


def test_speculative_greedy_equals_hf_generate(models):
  (hf_target, target), (_, draft) = models
  prompt = [3, 1, 4, 1, 5, 9, 2, 6]
  want = _hf_greedy(hf_target, prompt, 24)
  res = speculative.generate(target, draft, [prompt], 24, 4)
  assert res.tokens[0] == want
