"""GGUF checkpoints and int8 weights: round trips per tensor type, parity
with the same weights from safetensors, the tokenizer from GGUF metadata,
int8 accuracy and exactness, bad input.

Files are written in the test with the `gguf` package's own GGUFWriter and
`gguf.quants` (nothing is downloaded). gguf-py quantizes F16, BF16, Q8_0,
Q4_0 and Q4_1 but only dequantizes the K-quants: Q4_K and Q6_K tensors are
random blocks with small fp16 scales, which is all a dequantization round
trip needs.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

# pylint: disable=wrong-import-position
from specjax.formats import checkpoint
from specjax.decode import probes
from specjax.decode import generation
from specjax.formats import gguf as gguf_file
from specjax.formats import gguf_tokenizer, gguf_weights, gguf_write, hf
from specjax.model import kv_cache
from specjax.model import layers
from specjax.model import quant
from specjax.model import sampling
from specjax.model import sharding
from specjax.model import llama as model_lib
from specjax.decode import speculative
from specjax.model import steps
from specjax.formats.gguf_write import GGUF_CONFIG, gguf_permute, gguf_tensors
from specjax.model.config import ModelConfig, get_preset
from specjax.errors import CheckpointError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
Q = gguf.GGMLQuantizationType
# Every row length is a multiple of 256 (the K-quants' super-block).
CFG = ModelConfig("g", vocab_size=256, dim=256, n_layers=2, n_heads=4, n_kv_heads=2,
                  ffn_dim=512, norm_eps=1e-5, max_seq_len=128, attn_block=8,
                  bos_token_id=1, eos_token_id=2)
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")


def spread(params, seed=0):
  """Weights of std 0.05 and norms around 1, so logits spread by O(1)."""
  leaves, tree = jax.tree_util.tree_flatten(params)
  rs = np.random.RandomState(seed)
  out = [np.asarray(1 + 0.3 * rs.randn(*x.shape) if x.ndim == 1 else 0.05 * rs.randn(*x.shape),
                    np.float32) for x in leaves]
  return jax.tree_util.tree_unflatten(tree, [jnp.asarray(x) for x in out])


@pytest.fixture(scope="module")
def params():
  return spread(model_lib.init_params(CFG, 0))


def random_blocks(shape, qtype, seed=0):
  """Random bytes of a K-quant tensor [rows, cols] whose fp16 scales are 1e-3."""
  block, size = gguf.GGML_QUANT_SIZES[qtype]
  n = shape[0] * shape[1] // block
  b = np.random.RandomState(seed).randint(0, 256, (n, size)).astype(np.uint8)
  small = np.full((n, 1), 1e-3, np.float16).view(np.uint8)
  if qtype == Q.Q4_K:
    b[:, 0:2], b[:, 2:4] = small, small  # d, dmin
  else:  # Q6_K: d last
    b[:, -2:] = small
  return b.reshape(shape[0], shape[1] // block * size)


def encode(arr: np.ndarray, qtype):
  """(bytes or array as written, its dequantization by gguf.quants)."""
  if qtype == Q.F32:
    return arr.astype(np.float32), arr.astype(np.float32)
  if qtype in (Q.Q4_K, Q.Q6_K):
    raw = random_blocks(arr.shape, qtype, seed=arr.size % 97)
  else:
    raw = gguf.quants.quantize(arr.astype(np.float32), qtype)
  return raw, gguf.quants.dequantize(raw, qtype)


def write_model(path, cfg, params, qtype=Q.F32, arch="llama", edit=None, tokenizer=None):
  """A llama.cpp-style GGUF of `params` (names and q/k permutation from
  backends.llamacpp, the writer's tables) with 2-D weights in `qtype`, norms
  F32. Returns {GGUF name: what gguf.quants dequantizes the bytes to}."""
  tensors = gguf_tensors(cfg, params)
  if edit:
    edit(tensors)
  w = gguf.GGUFWriter(str(path), arch)
  for method, attr in GGUF_CONFIG:
    getattr(w, method)(getattr(cfg, attr))
  (tokenizer or dummy_vocab)(w, cfg)
  expect = {}
  for name, arr in tensors.items():
    arr = np.asarray(arr)
    if arr.ndim == 1 or qtype == Q.F32 or arr.dtype == np.int8:
      w.add_tensor(name, arr if arr.dtype == np.int8 else arr.astype(np.float32))
      expect[name] = arr
      continue
    raw, expect[name] = encode(np.asarray(arr, np.float32), qtype)
    if qtype == Q.F16:
      w.add_tensor(name, raw)
    else:
      w.add_tensor(name, raw, raw_dtype=qtype)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return expect


def dummy_vocab(w, cfg):
  w.add_tokenizer_model("llama")
  toks = ["<unk>", "<s>", "</s>"] + [f"\u2581t{i}" for i in range(3, cfg.vocab_size)]
  w.add_token_list(toks)
  w.add_token_scores([0.0] * cfg.vocab_size)
  w.add_token_types([2, 3, 3] + [1] * (cfg.vocab_size - 3))
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)


_forward = jax.jit(model_lib.forward, static_argnames="cfg")


def logits(cfg, params, toks):
  cache = kv_cache.init_cache(cfg, toks.shape[0], toks.shape[1])
  return np.asarray(_forward(params, jnp.asarray(toks), cache, cfg)[0])


TOKS = np.random.RandomState(1).randint(0, 256, (2, 24))

# ------------------------------------------------------------ round trips


@pytest.mark.parametrize("name", TYPES)
def test_round_trip_per_type(tmp_path, params, name):
  qtype = Q[name]
  expect = write_model(tmp_path / f"m-{name}.gguf", CFG, params, qtype)
  cfg, got, _ = gguf_weights.load_gguf(tmp_path / f"m-{name}.gguf", "float32")
  assert cfg == CFG.replace(name=f"m-{name}", attn_block=cfg.attn_block)
  state = hf.params_to_hf_state(cfg, got)
  for hf_name, arr in state.items():
    g_name = gguf_file.gguf_name(hf_name)
    if "q_proj" in hf_name or "k_proj" in hf_name:  # back to llama.cpp's row order
      heads = cfg.n_heads if "q_proj" in hf_name else cfg.n_kv_heads
      arr = gguf_permute(arr, heads)
    want = np.asarray(expect[g_name], np.float32)
    assert np.array_equal(arr, want), (name, hf_name)
  if name in ("F32", "F16", "BF16"):  # bit-exact up to the type
    np_type = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}[name]
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(params)):
      b = np.asarray(b)
      assert np.array_equal(np.asarray(a), b if b.ndim == 1 else b.astype(np_type).astype(np.float32))


def close_to(got, ref, mean=0.03, worst=0.15, agree=0.95):
  """|logit error| relative to the spread of the f32 logits: mean and max
  (2 layers of dim 256, weight std 0.05: a 0.7% rms weight error gives about
  2% mean and 10% worst)."""
  d = np.abs(got - ref) / ref.std()
  assert d.mean() < mean and d.max() < worst, (d.mean(), d.max())
  assert (got.argmax(-1) == ref.argmax(-1)).mean() > agree


def test_quantized_logits_are_close_to_f32(tmp_path, params):
  """Q8_0 logits are close to f32's (the quantized path computes the same
  model)."""
  write_model(tmp_path / "q8.gguf", CFG, params, Q.Q8_0)
  cfg, got, _ = gguf_weights.load_gguf(tmp_path / "q8.gguf", "float32")
  close_to(logits(cfg, got, TOKS), logits(CFG, params, TOKS))

# ------------------------------------------------------------ parity with safetensors


@pytest.mark.parametrize("tied", [False, True])
def test_gguf_equals_safetensors(tmp_path, params, tied):
  cfg = CFG.replace(tie_embeddings=tied)
  p = {k: v for k, v in params.items() if not (tied and k == "lm_head")}
  hf.save_hf(tmp_path / "hf", cfg, p)
  write_model(tmp_path / "m.gguf", cfg, p)
  hcfg, hparams, _ = checkpoint.load_model(str(tmp_path / "hf"))
  gcfg, gparams, tok = checkpoint.load_model(str(tmp_path / "m.gguf"))
  assert gcfg.tie_embeddings == tied and tok is not None
  assert gcfg == hcfg.replace(name=gcfg.name)
  # Both run under hcfg (equal but for the name): one compilation.
  assert np.array_equal(logits(hcfg, gparams, TOKS), logits(hcfg, hparams, TOKS))
  if not tied:  # greedy tokens too (once: a compilation per config)
    prompt = [[5, 17, 42, 9]]
    assert (generation.generate(steps.Runner(hcfg, gparams), prompt, 16).tokens
            == generation.generate(steps.Runner(hcfg, hparams), prompt, 16).tokens)


def test_qk_permutation_matters(tmp_path, params):
  """Loading without undoing llama.cpp's q/k row order changes the logits
  (the parity above is not vacuous)."""
  write_model(tmp_path / "m.gguf", CFG, params)
  _, got, _ = gguf_weights.load_gguf(tmp_path / "m.gguf")
  raw = jax.tree_util.tree_map(lambda x: x, got)
  for i in range(CFG.n_layers):
    for w, heads in (("wq", CFG.n_heads), ("wk", CFG.n_kv_heads)):
      k = np.asarray(got[f"layers_{i}"]["attn"][w]["kernel"])
      raw[f"layers_{i}"]["attn"][w] = {"kernel": jnp.asarray(gguf_permute(k.T, heads).T)}
  assert np.abs(logits(CFG, raw, TOKS) - logits(CFG, got, TOKS)).max() > 0.1

_MESH_WORKER = """
import json, sys
import numpy as np
from specjax.formats import checkpoint
from specjax.model import kv_cache
from specjax.model import llama as model
from specjax.model import sharding
path, out = sys.argv[1], {}
toks = np.arange(24).reshape(2, 12) * 7 % 256
for spec in (None, "data:2,model:2"):
  for dtype in ("float32", "int8"):
    with sharding.use(None if spec is None else sharding.make_mesh(spec)):
      cfg, params, _ = checkpoint.load_model(path, dtype=dtype)
      cache = kv_cache.init_cache(cfg, 2, 12)
      frac = params["layers_0"]["attn"]["wq"]
      leaf = frac["kernel"] if "kernel" in frac else frac["kernel_q"]
      logits = model.forward(params, toks, cache, cfg)[0]
      out[f"{spec}/{dtype}"] = {"logits": np.asarray(logits).tolist(),
                                "share": leaf.addressable_shards[0].data.size / leaf.size}
print(json.dumps(out))
"""


def test_sharded_load_equals_single_device(tmp_path, params):
  """A Q8_0 file loaded on meshes of 4 virtual devices (each device reads and
  dequantizes its own rows), float and int8: the single-device logits."""
  import json  # pylint: disable=import-outside-toplevel
  write_model(tmp_path / "q8.gguf", CFG, params, Q.Q8_0)
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
             XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4")
  proc = subprocess.run([sys.executable, "-c", _MESH_WORKER, str(tmp_path / "q8.gguf")],
                        env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  for dtype in ("float32", "int8"):
    ref = np.array(out[f"None/{dtype}"]["logits"])
    for spec in ("data:2,model:2",):
      got = out[f"{spec}/{dtype}"]
      np.testing.assert_allclose(np.array(got["logits"]), ref, atol=2e-5, err_msg=spec)
      assert got["share"] == 0.5, (spec, dtype)

# ------------------------------------------------------------ int8


def test_int8_logits_close_to_f32(params):
  """Per-channel int8: mean |logit error| < 3% and max < 15% of the f32
  logits' std (measured: 1.9% and 10.5%); argmax agrees at > 95% of
  positions."""
  qcfg, qparams = quant.quantize_model(CFG, params)
  assert qcfg.precision == "int8"
  wq = qparams["layers_0"]["attn"]["wq"]
  assert wq["kernel_q"].dtype == jnp.int8 and wq["kernel_scale"].shape == (CFG.dim,)
  assert model_lib.param_bytes(qparams) < 0.3 * model_lib.param_bytes(params)
  close_to(logits(qcfg, qparams, TOKS), logits(CFG, params, TOKS))


def test_int8_scale_is_applied(params):
  """Without the per-channel scale the logits are far off (the tolerance
  above is not vacuous)."""
  qcfg, qparams = quant.quantize_model(CFG, params)
  ones = jax.tree_util.tree_map_with_path(
      lambda p, x: jnp.ones_like(x) if "kernel_scale" in sharding.path_str(p) else x, qparams)
  ref = logits(CFG, params, TOKS)
  assert np.abs(logits(qcfg, ones, TOKS) - ref).max() > ref.std()


def test_int8_params_have_partition_specs():
  for cfg in (get_preset("tiny", "int8"), get_preset("tiny", "int8").replace(tie_embeddings=True)):
    shapes = jax.eval_shape(lambda c=cfg: model_lib.init_params(c))
    for path, x in jax.tree_util.tree_flatten_with_path(shapes)[0]:
      spec = sharding.param_spec(sharding.path_str(path))
      assert len(spec) in (0, x.ndim), (path, spec)


def test_int8_matmul_in_chunks_equals_one_product(monkeypatch):
  monkeypatch.setattr(layers, "INT8_CHUNK", 1 << 10)
  rs = np.random.RandomState(0)
  for shape in ((64, 512), (512, 64)):  # split on out, split on in
    assert layers._n_chunks(max(shape), 64 * 512) == 32  # pylint: disable=protected-access
    kq = rs.randint(-127, 128, shape).astype(np.int8)
    scale = rs.rand(shape[1]).astype(np.float32)
    x = rs.randn(3, 5, shape[0]).astype(np.float32)
    got = jax.jit(lambda x, k, s: layers.int8_matmul(x, k, s, jnp.float32))(x, kq, scale)
    want = (x.astype(np.float64) @ kq.astype(np.float64)) * scale
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-3)


def test_int8_decode_loop_holds_no_float_copy_of_the_kernels():
  """The compiled k-step decode loop's temporaries stay far below the
  kernels' float32 size: a convert hoisted out of the loop, or all converts
  alive at once, would need all of it."""
  if jax.default_backend() != "cpu":
    pytest.skip("the chunked int8 product is the CPU path")
  cfg = CFG.replace(vocab_size=8192, ffn_dim=1024).with_dtype("int8")
  params = jax.eval_shape(lambda: model_lib.init_params(cfg))
  cache = kv_cache.init_cache(cfg, 1, 64)
  compiled = probes.repeat_forward.lower(
      params, jnp.zeros((1, 1), jnp.int32), cache, jax.random.PRNGKey(0), cfg=cfg, k=4,
      sp=sampling.SamplingParams()).compile()
  kernels = sum(x.size * 4 for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
                if "kernel_q" in sharding.path_str(p))
  assert compiled.memory_analysis().temp_size_in_bytes < 0.2 * kernels


def test_greedy_speculative_with_int8_draft_equals_target_only(gamma=3):
  cfg = get_preset("tiny")
  tparams = model_lib.init_params(cfg, 1)
  tparams = {**tparams, "lm_head": {"kernel": tparams["lm_head"]["kernel"] * 40.0}}
  target = steps.Runner(cfg, tparams)
  draft = steps.Runner(*quant.quantize_model(cfg, tparams, role="draft"))
  for prompt in ([5, 17, 42, 9, 100], [200, 1, 64]):
    base = generation.generate(target, [prompt], 30).tokens
    res = speculative.generate(target, draft, [prompt], 30, gamma)
    assert res.tokens == base
    assert res.stats.n_accept > 0


def test_int8_from_gguf_and_preset(tmp_path, params):
  """--dtype=int8 on a Q8_0 GGUF (dequantized, requantized per channel) and
  on a preset (random init, quantized)."""
  write_model(tmp_path / "q8.gguf", CFG, params, Q.Q8_0)
  cfg, got, _ = checkpoint.load_model(str(tmp_path / "q8.gguf"), dtype="int8")
  assert cfg.quant == "int8" and got["lm_head"]["kernel_q"].dtype == jnp.int8
  close_to(logits(cfg, got, TOKS), logits(CFG, params, TOKS), mean=0.04, worst=0.2,
           agree=0.85)
  pcfg, pparams, _ = checkpoint.load_model("tiny", dtype="int8")
  assert pcfg.precision == "int8" and "kernel_q" in pparams["lm_head"]

# ------------------------------------------------------------ tokenizer

TEXTS = ["Hello world", "hello, world!", "  two leading spaces", " one leading space",
         "trailing space ", "multiple   inner    spaces", "new\nline\n\nand\ttab",
         "caf\u00e9 na\u00efve \u00e9t\u00e9", "\u4e2d\u6587\u5b57\u7b26", "emoji \U0001F600\U0001F680!",
         "def f(x):\n    return x ** 2  # square\n", "for i in range(10): print(i)",
         "numbers 12345 and 3.14159", ""]
CORPUS = ("The quick brown fox jumps over the lazy dog. Hello world, hello there!\n"
          "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
          "fibonacci(n - 2)\n\nfor i in range(10):\n    print(i, fibonacci(i))\n"
          "Caf\u00e9 cr\u00e8me br\u00fbl\u00e9e, na\u00efve r\u00e9sum\u00e9. \u4e2d\u6587 "
          "\u6587\u5b57. Numbers 12345 and 3.14159.\n  Indented  text   with spaces.\n")


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory):
  """A small LLaMA-style SentencePiece BPE (byte fallback, digits split,
  dummy prefix, whitespace kept) trained in the test."""
  import sentencepiece as spm  # pylint: disable=import-outside-toplevel
  d = tmp_path_factory.mktemp("sp")
  lines = [l for l in (CORPUS * 20).splitlines() if l] + [f"line {i} of text" for i in range(50)]
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(lines), model_prefix=str(d / "tokenizer"), model_type="bpe",
      vocab_size=420, byte_fallback=True, split_digits=True, add_dummy_prefix=True,
      remove_extra_whitespaces=False, normalization_rule_name="identity",
      allow_whitespace_only_pieces=True, character_coverage=1.0, hard_vocab_limit=False,
      unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
  return d


def write_vocab_only(path, write):
  w = gguf.GGUFWriter(str(path), "llama")
  write(w)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return gguf_tokenizer.gguf_tokenizer(gguf_file.open_reader(path), str(path))


def sp_vocab_writer(sp_dir, add_bos: bool, add_eos: bool, unk: int | None = None):
  """Writes a SentencePiece vocabulary as llama.cpp's converter does
  (gguf.SentencePieceVocab: pieces, scores, types), BOS 1, EOS 2."""
  toks, scores, types = zip(*gguf.SentencePieceVocab(sp_dir).all_tokens())

  def write(w):
    w.add_tokenizer_model("llama")
    w.add_token_list(list(toks))
    w.add_token_scores(list(scores))
    w.add_token_types([int(t) for t in types])
    if unk is not None:
      w.add_unk_token_id(unk)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(add_bos)
    w.add_add_eos_token(add_eos)
  return write


def test_llama_tokenizer_matches_sentencepiece(tmp_path, sp_dir):
  """Vocabulary written as llama.cpp's converter does (gguf.SentencePieceVocab:
  pieces, scores, types); ids equal SentencePiece's with BOS (LLaMA)."""
  import sentencepiece as spm  # pylint: disable=import-outside-toplevel
  sp = spm.SentencePieceProcessor(model_file=str(sp_dir / "tokenizer.model"))
  tok = write_vocab_only(tmp_path / "sp.gguf", sp_vocab_writer(sp_dir, True, False, unk=0))
  assert tok.vocab_size == sp.get_piece_size()
  for text in TEXTS:
    want = [1] + sp.encode(text)
    assert tok.encode(text) == want, text
    assert tok.encode(text, add_special=False) == want[1:], text
    assert tok.decode(want) == text, text
  # Control tokens written in the text are special tokens (as in HF's LLaMA
  # tokenizer.json); SentencePiece alone would spell them out.
  assert 2 in tok.encode("a</s>b", add_special=False)
  assert 2 not in sp.encode("a</s>b")


@pytest.fixture(scope="module")
def bpe_json(tmp_path_factory):
  """A small GPT-2-style byte-level BPE trained in the test."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # pylint: disable=import-outside-toplevel
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["<|endoftext|>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator([CORPUS] * 20, trainer)
  path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
  tok.save(str(path))
  return path


def test_gpt2_tokenizer_matches_tokenizers(tmp_path, bpe_json):
  import json  # pylint: disable=import-outside-toplevel
  from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel
  ref = Tokenizer.from_file(str(bpe_json))
  model = json.loads(bpe_json.read_text())["model"]
  vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
  merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
  eot = ref.token_to_id("<|endoftext|>")

  def write(w):
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if i == eot else 1 for _, i in vocab])
    w.add_token_merges(merges)
    w.add_bos_token_id(eot)
    w.add_eos_token_id(eot)
    w.add_add_bos_token(False)
  tok = write_vocab_only(tmp_path / "bpe.gguf", write)
  assert tok.vocab_size == ref.get_vocab_size()
  for text in TEXTS + ["<|endoftext|>between<|endoftext|>"]:
    want = ref.encode(text).ids
    assert tok.encode(text) == want, text
    assert tok.decode(want) == text.replace("<|endoftext|>", ""), text


def test_add_bos_false_and_eos_true(tmp_path, sp_dir):
  tok = write_vocab_only(tmp_path / "sp.gguf", sp_vocab_writer(sp_dir, False, True))
  ids = tok.encode("Hello world")
  assert ids[0] != 1 and ids[-1] == 2

def test_draft_and_target_tokens_must_agree(tmp_path, sp_dir):
  """The same pieces from SentencePiece and from a GGUF agree; a vocabulary
  of the same size with other strings is refused in one line."""
  from specjax.errors import TokenizerError  # pylint: disable=import-outside-toplevel
  from specjax.formats.tokenizer import check_same_tokens, load_tokenizer  # pylint: disable=import-outside-toplevel
  toks, scores, types = zip(*gguf.SentencePieceVocab(sp_dir).all_tokens())

  def vocab(pieces):
    def write(w):
      w.add_tokenizer_model("llama")
      w.add_token_list(pieces)
      w.add_token_scores(list(scores))
      w.add_token_types([int(t) for t in types])
    return write
  same = write_vocab_only(tmp_path / "a.gguf", vocab(list(toks)))
  check_same_tokens(load_tokenizer(sp_dir), same)
  other = list(toks)
  other[300] = "\u2581renamed"
  with pytest.raises(TokenizerError, match=r"vocabularies differ: token 300 is .* in the "
                                           r"target .*'\u2581renamed' in the draft"):
    check_same_tokens(same, write_vocab_only(tmp_path / "b.gguf", vocab(other)))

# ------------------------------------------------------------ bad input


def test_truncated_file(tmp_path, params):
  path = tmp_path / "m.gguf"
  write_model(path, CFG, params)
  data = path.read_bytes()
  for cut, what in ((len(data) - 1000, "truncated"), (100, "truncated or corrupt")):
    path.write_bytes(data[:cut])
    with pytest.raises(CheckpointError, match=what) as e:
      gguf_weights.load_gguf(path)
    assert "\n" not in str(e.value) and str(path) in str(e.value)


def test_not_gguf(tmp_path):
  path = tmp_path / "x.gguf"
  path.write_bytes(b"not a gguf file at all" * 10)
  with pytest.raises(CheckpointError, match=r"not a GGUF file: .* does not start with the GGUF magic"):
    checkpoint.load_model(str(path))


def test_other_architecture(tmp_path, params):
  write_model(tmp_path / "m.gguf", CFG, params, arch="gpt2")
  with pytest.raises(CheckpointError, match=r"architecture 'gpt2' is not supported \(only 'llama'\)"):
    gguf_weights.load_gguf(tmp_path / "m.gguf")


def test_unsupported_tensor_type(tmp_path, params):
  def edit(t):
    t["blk.1.ffn_up.weight"] = np.zeros(t["blk.1.ffn_up.weight"].shape, np.int8)
  write_model(tmp_path / "m.gguf", CFG, params, edit=edit)
  with pytest.raises(CheckpointError,
                     match=r"tensor blk\.1\.ffn_up\.weight has type I8, which the gguf "
                           r"package cannot dequantize"):
    gguf_weights.load_gguf(tmp_path / "m.gguf")


def test_missing_tensor(tmp_path, params):
  write_model(tmp_path / "m.gguf", CFG, params, edit=lambda t: t.pop("blk.0.attn_v.weight"))
  with pytest.raises(CheckpointError, match=r"missing tensor blk\.0\.attn_v\.weight"):
    gguf_weights.load_gguf(tmp_path / "m.gguf")


def test_unsupported_rope_scaling_type(tmp_path, params):
  def tok(w, cfg):
    dummy_vocab(w, cfg)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
  write_model(tmp_path / "m.gguf", CFG, params, tokenizer=tok)
  with pytest.raises(CheckpointError, match="rope scaling type 'yarn' is not supported"):
    gguf_weights.load_gguf(tmp_path / "m.gguf")


def llama3_factors(d_head, theta, factor=8.0, low=1.0, high=4.0, old_ctx=8192):
  """rope_freqs as llama.cpp's convert_hf_to_gguf.py computes them."""
  import math  # pylint: disable=import-outside-toplevel
  freqs = 1.0 / (theta ** (np.arange(0, d_head, 2, dtype=np.float32) / d_head))
  out = []
  for f in freqs:
    wavelen = 2 * math.pi / f
    if wavelen < old_ctx / high:
      out.append(1.0)
    elif wavelen > old_ctx / low:
      out.append(factor)
    else:
      smooth = (old_ctx / wavelen - low) / (high - low)
      out.append(1 / ((1 - smooth) / factor + smooth))
  return np.array(out, np.float32)


def test_llama3_rope_freqs(tmp_path, params):
  from specjax.model.config import RopeScaling  # pylint: disable=import-outside-toplevel
  def add(factors):
    return lambda t: t.update({"rope_freqs.weight": factors})
  write_model(tmp_path / "l3.gguf", CFG, params, edit=add(llama3_factors(64, 1e4, factor=32.0)))
  cfg, _, _ = gguf_weights.load_gguf(tmp_path / "l3.gguf")
  assert cfg.rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192)
  write_model(tmp_path / "odd.gguf", CFG, params,
              edit=add(llama3_factors(64, 1e4, factor=8.0, high=2.0)))
  with pytest.raises(CheckpointError, match="rope_freqs.weight is not LLaMA-3 scaling"):
    gguf_weights.load_gguf(tmp_path / "odd.gguf")


def run_script(*args):
  return subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "speculative.py"),
                         *args], capture_output=True, text=True, timeout=300, cwd=ROOT)


def one_line_error(proc, pattern):
  import re  # pylint: disable=import-outside-toplevel
  assert proc.returncode != 0, proc.stdout
  assert "Traceback" not in proc.stderr, proc.stderr
  errors = [l for l in proc.stderr.splitlines() if re.search(pattern, l)]
  assert errors and len(errors[0]) < 600, proc.stderr


def test_scripts_on_gguf_files(tmp_path, params):
  """A GGUF target with an int8 GGUF draft runs; a GGUF draft of another
  vocabulary is one line and exit 1 (the other bad files' lines are the
  same CheckpointErrors, tested above)."""
  tiny = get_preset("tiny")
  write_model(tmp_path / "t.gguf", tiny, model_lib.init_params(tiny, 0))
  draft = get_preset("tiny-draft")
  write_model(tmp_path / "d.gguf", draft, model_lib.init_params(draft, 1))
  other = draft.replace(vocab_size=300)
  write_model(tmp_path / "v300.gguf", other, model_lib.init_params(other, 1))
  proc = run_script(f"--model={tmp_path / 't.gguf'}", f"--model_draft={tmp_path / 'd.gguf'}",
                    "--dtype_draft=int8", "--n_predict=8", "--draft=2", "--reps=1",
                    "--nobaseline", "--prompt_tokens=1,5,9")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "int8" in proc.stdout or "n_drafted" in proc.stdout
  one_line_error(run_script(f"--model={tmp_path / 't.gguf'}",
                            f"--model_draft={tmp_path / 'v300.gguf'}", "--n_predict=4"),
                 r"error: draft and target vocabularies differ")

# ------------------------------------------------------------ llama.cpp on the same file

# specjax against llama.cpp on the very same GGUF file: the shipped trained
# stdlib-draft (dim 192, 2 layers, head size 32, vocabulary 4096: every row a
# whole number of Q8_0 blocks) written as F16 and as Q8_0, real code prompts
# (its tokenizer, cut to 8 tokens), 16 greedy tokens each.
#
# Logits: max |specjax - llama.cpp| over the vocabulary at every step,
# relative to the std of specjax's logits there. Both run the same weights
# (specjax dequantizes the file exactly, to float32, and computes in f32);
# what differs is llama.cpp's matmuls: F16 weights meet activations rounded to
# F16 (2^-11 relative), Q8_0 weights meet activations quantized to Q8_0 per
# block of 32 (its vec_dot_q8_0_q8_0: 2^-8 of each block's max), so Q8_0's
# error is some 30x F16's. Measured (dev machine, AVX2, llama-cpp-python
# 0.3.36): F16 1.6e-3, Q8_0 4.5e-2 at worst; the tolerances are about 3x that.
#
# Tokens: equal from the first on, except that they may part at a near-tie:
# a step where specjax's logit of llama.cpp's token is within 2 x tolerance
# of specjax's top logit (the tolerance admits the flip); that prompt is
# compared no further. At least 90% of all steps must be compared; measured:
# all 16 tokens of every prompt equal for both files, although the smallest
# top-2 gap (7e-3 std) is below the Q8_0 tolerance (the errors of the top
# two logits are close): the rule is for other CPUs or prompts.
LLAMA_CPP_TOL = {"F16": 5e-3, "Q8_0": 0.15}
LLAMA_CPP_TEXTS = ("import os\nimport sys\nimport re\n", "def main(argv):\n    parser = ",
                   "class Parser(object):\n    def __init__(self",
                   "for i in range(len(items)):\n", "if __name__ == '__main__':\n")
N_GREEDY = 16
LLAMA_CPP_PROMPT = 8  # prompt tokens


@pytest.fixture(scope="module")
def llama_cpp():
  return pytest.importorskip("llama_cpp", reason="llama.cpp tests need the optional "
                             "extra: pip install -e '.[llamacpp]'")


def llama_cpp_greedy(backend, prompt, n):
  """llama.cpp's own greedy continuation of `prompt` on its file: n tokens
  and, for each, the logits [V] it is the argmax of. All but the prompt's
  last token fill the cache; then one llama_decode per token, the cache kept
  (the backend's depth moved past each decoded token)."""
  backend.prepare(np.array([prompt[:-1]]), len(prompt) + n, 1)
  tok, toks, rows = prompt[-1], [], []
  for _ in range(n):
    rows.append(backend.logits(np.array([[tok]]))[0, 0])
    tok = int(rows[-1].argmax())
    toks.append(tok)
    backend.depth += 1
  return toks, np.stack(rows)


@pytest.mark.parametrize("name", ["F16", "Q8_0"])
def test_greedy_and_logits_equal_llama_cpp_on_the_same_file(llama_cpp, tmp_path, name):
  """specjax on a GGUF file (checkpoint.load_model) and llama.cpp on that same
  file (LlamaCppBackend with gguf_path, as batch_scaling runs a GGUF model):
  greedy tokens and logits agree as stated above; batch_scaling's parity
  metric is within the backend's tolerance for the file."""
  from specjax.bench.backends import base, llamacpp  # pylint: disable=import-outside-toplevel
  del llama_cpp
  cfg0, params0, tok = checkpoint.load_model("stdlib-draft", "float32")
  path = gguf_write.write_gguf(tmp_path / f"stdlib-draft-{name}.gguf", cfg0, params0,
                             tensor_type=name)
  cfg, params, _ = checkpoint.load_model(str(path))
  prompts = [tok.encode(t)[:LLAMA_CPP_PROMPT] for t in LLAMA_CPP_TEXTS]
  want = generation.generate(steps.Runner(cfg, params), prompts, N_GREEDY).tokens
  ref = logits(cfg, params, np.array([p + t for p, t in zip(prompts, want)]))[:, LLAMA_CPP_PROMPT - 1:][:, :N_GREEDY]
  try:
    ll = llamacpp.LlamaCppBackend(cfg, params, threads=2, gguf_path=path)
  except base.Unavailable as e:
    pytest.skip(f"llama.cpp: {e}")
  tol, compared, errs, gaps = LLAMA_CPP_TOL[name], 0, [], []
  try:
    assert ll.path == path and ll.parity_tol > 0
    for i, prompt in enumerate(prompts):
      toks, rows = llama_cpp_greedy(ll, prompt, N_GREEDY)
      n = next((t for t in range(N_GREEDY) if toks[t] != want[i][t]), N_GREEDY)
      m = min(n + 1, N_GREEDY)  # steps run on the same prefix
      std = ref[i, :m].std(-1, keepdims=True)
      errs.append(float((np.abs(rows[:m] - ref[i, :m]) / std).max()))
      top2 = np.sort(ref[i, :m], -1)[:, -2:]
      gaps.append(float(((top2[:, 1] - top2[:, 0]) / std[:, 0]).min()))
      assert errs[-1] < tol, (name, i, errs[-1], tol)
      base.check_parity(ref[i, :m], rows[:m], max(base.parity_tolerance(ll.name, cfg.dtype),
                                                  ll.parity_tol), f"{name} prompt {i}")
      if n < N_GREEDY:  # parted: only where the tolerance admits the flip
        gap = (ref[i, n, want[i][n]] - ref[i, n, toks[n]]) / std[n, 0]
        assert gap < 2 * tol, (name, i, n, toks, want[i], gap)
      compared += n
  finally:
    ll.close()
  assert path.is_file()  # a given file is never removed
  print(f"{name}: {compared}/{len(prompts) * N_GREEDY} greedy tokens equal; max "
        f"|dlogit| / std {max(errs):.2e} (tolerance {tol:g}); min top-2 gap / std "
        f"{min(gaps):.2e}")
  assert compared >= 0.9 * len(prompts) * N_GREEDY


def test_batch_scaling_runs_llama_cpp_on_the_given_file(llama_cpp, tmp_path, monkeypatch):
  """batch_scaling on a Q8_0 GGUF model: llama.cpp is given that file (not
  one written from the dequantized params) and passes the parity check
  under the file's tolerance (measured 4.5e-3 to 7e-3 of max |logit|)."""
  sys.path.insert(0, ROOT)
  import configs.batch_scaling as bs_config  # pylint: disable=import-outside-toplevel
  from specjax.bench.studies import batch_scaling  # pylint: disable=import-outside-toplevel
  from specjax.bench.backends import llamacpp  # pylint: disable=import-outside-toplevel
  del llama_cpp
  cfg, params, _ = checkpoint.load_model("stdlib-draft", "float32")
  path = gguf_write.write_gguf(tmp_path / "sd-Q8_0.gguf", cfg, params, tensor_type="Q8_0")
  given = []
  real = llamacpp.LlamaCppBackend
  monkeypatch.setattr(llamacpp, "LlamaCppBackend",
                      lambda *a, **k: given.append(a[4:]) or real(*a, **k))
  monkeypatch.setattr(gguf_write, "write_gguf", None)  # nothing may be written
  c = bs_config.get_config("tiny")
  c.models, c.backends, c.draft = (str(path),), ("xla", "llama.cpp"), ""
  c.batches, c.rounds = (1,), 1
  batch_scaling.run_batch_scaling(c, str(tmp_path / "w"), log=lambda s: None)
  assert given == [(str(path),)]  # (gguf_path,) after cfg, params, threads, flash_attn
  import json  # pylint: disable=import-outside-toplevel
  parity = json.loads((tmp_path / "w" / "parity.json").read_text())
  assert [(p["backend"], p["tolerance"]) for p in parity] == [
      ("llama.cpp", llamacpp.PARITY_TOL_QUANTIZED)]
  assert parity[0]["parity_error"] < llamacpp.PARITY_TOL_QUANTIZED
