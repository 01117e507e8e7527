"""GGUF files against an independent reader: transformers.

tests/formats/test_gguf.py checks specjax's GGUF reader against specjax's own
writer: the tensor names and the q/k permutation come from one table
(gguf.GGUF_LAYER, gguf.gguf_permute) on both sides and the expected weights
are the loader's own dequantization, so a bug in the table (gate and up
swapped, the permutation inverted) round-trips and passes there. Here a tiny
GQA LLaMA written by gguf_write is read by transformers too, whose GGUF
loader has its own tensor names (gguf-py's tensor name map), its own reverse
q/k permutation and its own metadata mapping: both must give the same float32
logits, for an F32, an F16, a BF16 and a Q8_0 file. Each deliberate bug in
MUTATIONS makes them differ (the shared-table ones still round-trip in
specjax, which is what the tests of test_gguf.py see).

transformers dequantizes with gguf-py (`gguf.dequantize`), as specjax does,
so it is no reference for the block formats: those are decoded by hand here
from the GGML layout (test_dequantize_equals_ggml_layout).

The tokenizer: the writer's placeholder vocabulary (<unk> <s> </s>, the 256
byte tokens, '▁tN' pieces without merges), read by transformers'
AutoTokenizer, gives the same ids and text as specjax's on plain text; the
two known divergences are left out of TEXTS (see there).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

# pylint: disable=wrong-import-position
from specjax.formats import checkpoint
from specjax.formats import gguf as gguf_file
from specjax.formats import gguf_tokenizer, gguf_weights, gguf_write
from specjax.model import kv_cache
from specjax.model import llama as model_lib
from specjax.model.config import ModelConfig

# GQA (4 query heads on 2 K/V heads, head size 16: the q/k permutation is no
# involution), rope theta and norm epsilon off their defaults, untied head;
# every row a whole number of Q8_0 blocks; vocabulary 288 > 3 + 256 bytes.
CFG = ModelConfig("ref", vocab_size=288, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                  ffn_dim=96, norm_eps=1e-6, max_seq_len=64, rope_theta=5e5,
                  bos_token_id=1, eos_token_id=2)
TYPES = ("F32", "F16", "BF16", "Q8_0")
TOL = 1e-4  # max |specjax - transformers| / std of transformers' logits (f32)
TOKS = np.random.RandomState(1).randint(0, CFG.vocab_size, (2, 32))


@pytest.fixture(scope="module")
def params():
  """Weights of std 0.1 and norms around 1 (not 1), so logits spread by O(1)."""
  leaves, tree = jax.tree_util.tree_flatten(model_lib.init_params(CFG, 0))
  rs = np.random.RandomState(0)
  out = [1 + 0.3 * rs.randn(*x.shape) if x.ndim == 1 else 0.1 * rs.randn(*x.shape)
         for x in leaves]
  return jax.tree_util.tree_unflatten(tree, [jnp.asarray(x, jnp.float32) for x in out])


@pytest.fixture(scope="module")
def transformers():
  pytest.importorskip("torch", reason="needs torch (pip install -e '.[test]')")
  return pytest.importorskip("transformers",
                             reason="needs transformers (pip install -e '.[test]')")


def write(path, name: str, params):
  """gguf_write's file of `params` with 2-D weights in type `name`."""
  return gguf_write.write_gguf(path, CFG, params, None if name == "F32" else name)


_forward = jax.jit(model_lib.forward, static_argnames="cfg")


def specjax_logits(path, toks=TOKS):
  """Logits of the file as specjax loads it (checkpoint.load_model, float32)."""
  cfg, params, _ = checkpoint.load_model(str(path), dtype="float32")
  cfg = cfg.replace(name=CFG.name)  # the file's stem; one compilation per config
  cache = kv_cache.init_cache(cfg, toks.shape[0], toks.shape[1])
  return np.asarray(_forward(params, jnp.asarray(toks), cache, cfg)[0])


def memory_logits(params, toks=TOKS):
  """Logits of `params` as they are, no file (what a round trip must give)."""
  cache = kv_cache.init_cache(CFG, toks.shape[0], toks.shape[1])
  return np.asarray(_forward(params, jnp.asarray(toks), cache, CFG)[0])


def transformers_model(transformers, path):
  """The file as transformers reads it: what LlamaForCausalLM.from_pretrained(
  dir, gguf_file=name) does for llama (transformers 5.x: the config from the
  metadata, the tensors by load_gguf_checkpoint, i.e. gguf-py's name map, the
  reverse q/k permutation and gguf.dequantize), called directly because
  from_pretrained insists on accelerate (not a test dependency), which this
  path does not use: with that check lifted it gives identical logits."""
  import torch  # pylint: disable=import-outside-toplevel
  from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint  # pylint: disable=import-outside-toplevel
  config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
  config._attn_implementation = "eager"  # pylint: disable=protected-access
  model = transformers.LlamaForCausalLM(config).eval()
  state = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
  model.load_state_dict({k: torch.as_tensor(v) for k, v in state.items()}, strict=True)
  return model


def transformers_logits(transformers, path, toks=TOKS):
  import torch  # pylint: disable=import-outside-toplevel
  model = transformers_model(transformers, path)
  assert model.config.num_key_value_heads == CFG.n_kv_heads < model.config.num_attention_heads
  with torch.no_grad():
    return model(torch.tensor(toks)).logits.float().numpy()


def error(got, ref) -> float:
  return float(np.abs(got - ref).max() / ref.std())

# ------------------------------------------------------------ logits


@pytest.mark.parametrize("name", TYPES)
def test_logits_equal_transformers(transformers, tmp_path, params, name):
  """specjax and transformers on the same file: the same float32 logits
  (measured: about 3e-6 of the logits' std for every type)."""
  path = write(tmp_path / f"m-{name}.gguf", name, params)
  ref = transformers_logits(transformers, path)
  assert ref.std() > 0.3, "weights too small for a meaningful comparison"
  err = error(specjax_logits(path), ref)
  print(f"{name}: max |specjax - transformers| / std {err:.1e}")
  assert err < TOL, (name, err)


def _swap_gate_up(monkeypatch):
  """gate and up swapped in the one name table (writer and reader)."""
  table = gguf_file.GGUF_LAYER
  gate, up = table["mlp.gate_proj"], table["mlp.up_proj"]
  monkeypatch.setitem(table, "mlp.gate_proj", up)
  monkeypatch.setitem(table, "mlp.up_proj", gate)


def _inverse_permute(w, n_head):
  """gguf_permute's inverse (its argsort): llama.cpp's order -> HF's."""
  return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


def _patch_permute(monkeypatch, fn):
  """`fn` for gguf_permute wherever the writer and reader find it."""
  for module in (gguf_file, gguf_write):
    if hasattr(module, "gguf_permute"):
      monkeypatch.setattr(module, "gguf_permute", fn)


def _hide_field(key):
  def patch(monkeypatch):
    real = gguf_file.field
    monkeypatch.setattr(gguf_file, "field", lambda reader, k, default=None:
                        default if k == key else real(reader, k, default))
  return patch


def _q8_0_unscaled(monkeypatch):
  """Q8_0 read without its block scales (the int8 values as they are)."""
  real = gguf_file.dequantize

  def dequantize(t, rows=slice(None)):
    if t.tensor_type != gguf.GGMLQuantizationType.Q8_0:
      return real(t, rows)
    data = t.data.view(np.ndarray)[rows]
    return ggml_decode(data, t.tensor_type, scaled=False)
  monkeypatch.setattr(gguf_file, "dequantize", dequantize)


# name: (patch(monkeypatch), file type, whether specjax still reads back what
# it wrote: True for the shared-table bugs test_gguf.py cannot see)
MUTATIONS = {
    "gate and up swapped in the name table": (_swap_gate_up, "F32", True),
    "q/k permutation inverted (writer and reader)":
        (lambda mp: _patch_permute(mp, _inverse_permute), "F32", True),
    "q/k permutation not applied (writer and reader)":
        (lambda mp: _patch_permute(mp, lambda w, n_head: w), "F32", True),
    "q/k permutation not undone on read":
        (lambda mp: mp.setattr(gguf_weights.GGUFState, "_perm", lambda self, name: None),
         "F32", False),
    "rope theta not read (the reader's default 10000)":
        (_hide_field("llama.rope.freq_base"), "F32", False),
    "Q8_0 block scales dropped on read": (_q8_0_unscaled, "Q8_0", False),
}


@pytest.mark.parametrize("bug", list(MUTATIONS))
def test_each_deliberate_bug_fails_the_comparison(transformers, tmp_path, params,
                                                  monkeypatch, bug):
  """Under each bug, specjax's logits of the file it wrote differ from
  transformers' far beyond TOL; the shared-table bugs still pass specjax's
  own round trip (the file read back gives the in-memory logits)."""
  patch, name, round_trips = MUTATIONS[bug]
  patch(monkeypatch)
  try:
    path = write(tmp_path / f"bug-{name}.gguf", name, params)
    got = specjax_logits(path)
  finally:
    monkeypatch.undo()
  err = error(got, transformers_logits(transformers, path))
  print(f"MUTATION | {bug} | max |specjax - transformers| / std {err:.3g}")
  assert err > 100 * TOL, (bug, err)
  if round_trips:
    assert error(got, memory_logits(params)) < TOL, bug

# ------------------------------------------------------------ block formats


def ggml_decode(raw: np.ndarray, qtype, scaled: bool = True) -> np.ndarray:
  """A tensor's bytes [rows, row bytes] decoded from the GGML layout, without
  gguf-py: F16 and BF16 (the top half of an f32) little-endian; Q8_0 blocks
  of 34 bytes, an f16 scale d then 32 int8 q, each weight d * q."""
  Q = gguf.GGMLQuantizationType
  raw = np.ascontiguousarray(raw).view(np.uint8)
  rows = raw.shape[0]
  if qtype == Q.F16:
    return raw.view("<f2").astype(np.float32)
  if qtype == Q.BF16:
    return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
  if qtype == Q.Q8_0:
    blocks = raw.reshape(rows, -1, 34)
    d = blocks[..., :2].copy().view("<f2").astype(np.float32)  # [rows, blocks, 1]
    q = blocks[..., 2:].view(np.int8).astype(np.float32)       # [rows, blocks, 32]
    return (q * d if scaled else q).reshape(rows, -1)
  raise NotImplementedError(qtype.name)


@pytest.mark.parametrize("name", TYPES[1:])
def test_dequantize_equals_ggml_layout(tmp_path, params, name):
  """specjax's dequantization of every 2-D tensor of an F16 / BF16 / Q8_0
  file equals the hand decoding of its bytes, and is close to the written
  float32 weights (the file holds what was written)."""
  path = write(tmp_path / f"m-{name}.gguf", name, params)
  written = gguf_write.gguf_tensors(CFG, params)
  reader = gguf_file.open_reader(path)
  tol = {"F16": 1e-3, "BF16": 8e-3, "Q8_0": 1e-2}[name]  # of max |weight|
  n = 0
  for t in reader.tensors:
    if len(t.shape) < 2:
      continue
    assert t.tensor_type.name == name, t.name
    want = ggml_decode(t.data.view(np.ndarray), t.tensor_type)
    assert np.array_equal(gguf_file.dequantize(t), want), t.name
    w = np.asarray(written[t.name], np.float32)
    assert np.abs(want - w).max() <= tol * np.abs(w).max(), t.name
    n += 1
  assert n == 2 + 7 * CFG.n_layers  # embedding, head, 7 per layer

# ------------------------------------------------------------ tokenizer

# Plain text. Left out, where specjax follows SentencePiece and llama.cpp
# (test_gguf.py checks it against SentencePiece) and transformers does not:
# text starting with whitespace (SentencePiece's dummy prefix makes
# " one" '▁▁one'; transformers' Metaspace does not prepend to text that
# already starts with '▁') and control tokens written in the text
# ("a</s>b": llama.cpp prefixes the text after a special token with '▁'
# too; transformers does not).
TEXTS = ["Hello world", "hello, world!", "trailing space ", "multiple   inner    spaces",
         "new\nline\n\nand\ttab", "caf\u00e9 na\u00efve \u00e9t\u00e9", "\u4e2d\u6587\u5b57",
         "emoji \U0001F600!", "def f(x):\n    return x ** 2  # square\n",
         "numbers 12345 and 3.14159", "t260 t261", ""]


@pytest.fixture(scope="module")
def f32_file(tmp_path_factory, params):
  return write(tmp_path_factory.mktemp("ref") / "m-F32.gguf", "F32", params)


def tokenizer_mismatches(transformers, path) -> list[str]:
  """TEXTS whose ids (BOS added) or decoded text differ between specjax's
  tokenizer of the file and transformers' AutoTokenizer of it."""
  _, _, ours = checkpoint.load_model(str(path), dtype="float32")
  theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
  bad = []
  for text in TEXTS:
    ids = theirs(text).input_ids
    if ours.encode(text) != ids or ours.decode(ids) != theirs.decode(ids, skip_special_tokens=True):
      bad.append(f"{text!r}: {ours.encode(text)} vs {ids}")
  return bad


def test_tokenizer_equals_transformers(transformers, f32_file):
  assert not tokenizer_mismatches(transformers, f32_file)


def test_tokenizer_without_bos_fails_the_comparison(transformers, f32_file, monkeypatch):
  """The deliberate bug: no BOS / EOS post-processing (add_bos_token
  ignored); every text then differs."""
  monkeypatch.setattr(gguf_tokenizer, "_post_processor", lambda *a, **k: None)
  assert len(tokenizer_mismatches(transformers, f32_file)) == len(TEXTS)
