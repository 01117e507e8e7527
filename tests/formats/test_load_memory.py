"""Loading within memory (formats/convert.py, gguf_weights.default_dtype):
the leaf-by-leaf loader gives the old loader's params bit for bit, picks
the default precision from the file's weight types, the backend and the
size (and logs it), holds no more over a short run at the CPU default than
at float32, and never holds the float32 model on the host.

The old loader, rebuilt here as the reference: every tensor dequantized
whole to float32 (GGUFState[name]), cast by jnp.asarray, int8 quantized
from the whole float32 model by quant.quantize_params.
"""

from __future__ import annotations

import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

# pylint: disable=wrong-import-position
from specjax.formats import checkpoint, convert
from specjax.formats import gguf as gguf_file
from specjax.formats import gguf_weights, gguf_write, hf
from specjax.decode import generation
from specjax.model import llama as model_lib
from specjax.model import quant, steps
from specjax.model.config import ModelConfig
from specjax.model.sampling import SamplingParams

# Rows of 64 and 128: whole Q8_0 blocks (32).
CFG = ModelConfig("m", vocab_size=100, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                  ffn_dim=128, norm_eps=1e-5, max_seq_len=64, bos_token_id=1,
                  eos_token_id=2)
KINDS = ("F32", "F16", "BF16", "Q8_0")
SMALL_CHUNK = 4096  # bytes: 8 to 16 rows a block, every tensor in several


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  """{kind: path}: the same random weights as F32, F16, BF16, Q8_0 GGUF
  files, and 'hf-bf16' a bf16 safetensors directory."""
  root = tmp_path_factory.mktemp("load_memory")
  leaves, tree = jax.tree_util.tree_flatten(model_lib.init_params(CFG, 0))
  rs = np.random.RandomState(0)
  params = jax.tree_util.tree_unflatten(tree, [
      jnp.asarray(1 + 0.3 * rs.randn(*x.shape) if x.ndim == 1 else 0.05 * rs.randn(*x.shape),
                  jnp.float32) for x in leaves])
  out = {}
  for kind in KINDS:
    plain = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}.get(kind)
    out[kind] = root / f"m-{kind}.gguf"
    if plain:
      gguf_write.write_gguf(out[kind], CFG.with_dtype(plain), params)
    else:
      gguf_write.write_gguf(out[kind], CFG, params, tensor_type=kind)
  bf16 = CFG.with_dtype("bfloat16")
  out["hf-bf16"] = hf.save_hf(root / "hf", bf16, jax.tree_util.tree_map(
      lambda x: x.astype(jnp.bfloat16), params))
  return out


def old_load(path, dtype: str, vocab_multiple: int = 1):
  """The reference: whole float32 tensors, cast; int8 from the float32
  model; `vocab_multiple` zero rows as np.pad added them."""
  reader = gguf_file.open_reader(path)
  cfg = gguf_file.read_config(reader, str(path), name=path.stem).with_dtype("float32")
  state = gguf_weights.GGUFState(reader, cfg, str(path))
  cast = cfg.with_dtype(dtype).replace(vocab_multiple=vocab_multiple)
  params: dict = {}
  for t in hf.tensor_map(cfg):
    arr = np.asarray(state[t.hf_name], np.float32)
    if t.hf_name in hf.VOCAB_TENSORS:
      arr = np.pad(arr, [(0, cast.padded_vocab - cfg.vocab_size), (0, 0)])
    node = params
    for key in t.path[:-1]:
      node = node.setdefault(key, {})
    node[t.path[-1]] = jnp.asarray(arr.T if t.transpose else arr, cast.jnp_param_dtype)
  return quant.quantize_params(params) if cast.quant else params


def differences(got, want) -> list[str]:
  """Leaves whose dtype, shape or bits differ."""
  out = []
  flat_got = dict(jax.tree_util.tree_flatten_with_path(got)[0])
  for path, w in jax.tree_util.tree_flatten_with_path(want)[0]:
    g = flat_got.get(path)
    w = np.asarray(w)
    if g is None or np.asarray(g).dtype != w.dtype or np.asarray(g).shape != w.shape:
      out.append(f"{jax.tree_util.keystr(path)}: {None if g is None else (g.dtype, g.shape)}")
      continue
    g = np.asarray(g)
    if not np.array_equal(g.view(np.uint8), w.view(np.uint8)):
      out.append(jax.tree_util.keystr(path))
  return out

# ------------------------------------------------------------ exactness


@pytest.mark.parametrize("chunk", [convert.CHUNK_BYTES, SMALL_CHUNK])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("kind", ["F32", "BF16", "Q8_0"])
def test_leaf_by_leaf_equals_the_old_loader(files, monkeypatch, kind, dtype, chunk):
  """Each file type, each precision, whole tensors or blocks of rows: the
  params of the old loader, bit for bit (bf16: the same rounding; int8:
  quantize_rows = quantize_kernel)."""
  monkeypatch.setattr(convert, "CHUNK_BYTES", chunk)
  cfg, got, _ = gguf_weights.load_gguf(files[kind], dtype)
  assert cfg.precision == dtype
  assert not differences(got, old_load(files[kind], dtype))


def _true_divisions(w):
  """quantize_rows as IEEE divisions (amax / 127, w / scale): XLA multiplies
  by reciprocals, and a bf16 weight's quotient can sit on a .5 tie."""
  w = np.asarray(w, np.float32)
  amax = np.max(np.abs(w), axis=1)
  scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
  return np.clip(np.round(w / scale[:, None]), -127, 127).astype(np.int8), scale


def _truncating_read(monkeypatch):
  """Blocks cut to bf16 precision toward zero before the cast (not RNE)."""
  real = convert.read

  def read(state, name, index):
    block = np.array(real(state, name, index), np.float32)
    return (block.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
  monkeypatch.setattr(convert, "read", read)


# name: (patch, file, dtype)
EXACT_MUTATIONS = {
    "int8 by IEEE divisions": (
        lambda mp: mp.setattr(quant, "quantize_rows", _true_divisions), "BF16", "int8"),
    "bf16 rounded toward zero": (_truncating_read, "F32", "bfloat16"),
}


@pytest.mark.parametrize("bug", list(EXACT_MUTATIONS))
def test_each_rounding_bug_is_caught(files, monkeypatch, bug):
  patch, kind, dtype = EXACT_MUTATIONS[bug]
  patch(monkeypatch)
  _, got, _ = gguf_weights.load_gguf(files[kind], dtype)
  assert differences(got, old_load(files[kind], dtype))


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_padded_vocabulary_equals_the_old_loader(files, monkeypatch, dtype):
  """A padded vocabulary (a mesh's model axis that does not divide V): zero
  rows after the file's, in the block-by-block host path too (int8: the
  padding channels quantize to 0 with scale 1, as quantize_kernel does)."""
  monkeypatch.setattr(convert, "CHUNK_BYTES", SMALL_CHUNK)
  path = files["Q8_0"]
  reader = gguf_file.open_reader(path)
  cfg = gguf_file.read_config(reader, str(path), name=path.stem).with_dtype(dtype)
  cfg = cfg.replace(vocab_multiple=64)  # 100 -> 128 rows
  got = hf.hf_state_to_params(cfg, gguf_weights.GGUFState(reader, cfg, str(path)))
  assert got["embed"]["embedding"].shape == (128, CFG.dim)
  assert not differences(got, old_load(path, dtype, vocab_multiple=64))


def test_hf_int8_equals_quantize_params_of_float32(files):
  """An HF bf16 directory at int8 (quantized as read) equals quantize_params
  of its float32 load (what load_model did before)."""
  qcfg, qparams, _ = checkpoint.load_model(str(files["hf-bf16"]), "int8")
  _, fparams, _ = checkpoint.load_model(str(files["hf-bf16"]), "float32")
  assert qcfg.quant == "int8"
  assert not differences(qparams, quant.quantize_params(fparams))


def test_release_keeps_the_tensor_readable(files):
  """GGUFState.release drops the pages, not the data: a later read equals."""
  reader = gguf_file.open_reader(files["Q8_0"])
  state = gguf_weights.GGUFState(reader, gguf_file.read_config(reader, "m"), "m")
  name = "model.embed_tokens.weight"
  before = np.array(state[name])
  state.release(name)
  assert np.array_equal(state[name], before)

# ------------------------------------------------------------ default precision

# Without --dtype on this (CPU) machine: the test model fits, so float32 throughout.
WANT_DEFAULT = {"F32": "float32", "F16": "float32", "BF16": "float32", "Q8_0": "float32"}
# (file, backend, memory in units of the file's float32 bytes, the default wanted)
CHOICES = [("Q8_0", "cpu", 100, "float32"), ("Q8_0", "cpu", 1.5, "bf16-mixed"),
           ("Q8_0", "gpu", 100, "bfloat16"), ("Q8_0", "tpu", 1.5, "bfloat16"),
           ("BF16", "cpu", 100, "float32"), ("BF16", "cpu", 1.5, "bf16-mixed"),
           ("BF16", "gpu", 1.5, "bfloat16"), ("F16", "gpu", 1.5, "float32"),
           ("F16", "cpu", 1.5, "float32"), ("F32", "gpu", 1.5, "float32")]


def _logged(monkeypatch, module, level: str = "info") -> list[str]:
  lines: list[str] = []
  monkeypatch.setattr(module.logging, level, lambda fmt, *a: lines.append(fmt % a))
  return lines


def default_mismatches(files, monkeypatch) -> list[str]:
  """Files whose load without --dtype is not WANT_DEFAULT's precision in
  every leaf, or not logged in one line naming file, type and precision."""
  bad = []
  for kind, want in WANT_DEFAULT.items():
    lines = _logged(monkeypatch, gguf_weights, "warning")
    cfg, params, _ = gguf_weights.load_gguf(files[kind])
    dtypes = {str(x.dtype) for x in jax.tree_util.tree_leaves(params)}
    said = [s for s in lines if " weights -> " in s]
    if cfg.precision != want or dtypes != {want}:
      bad.append(f"{kind}: {cfg.precision} {sorted(dtypes)}")
    if len(said) != 1 or not said[0].startswith(f"{files[kind]}: {kind} weights -> {want} ("):
      bad.append(f"{kind}: logged {said}")
  lines = _logged(monkeypatch, hf)  # an HF directory: its torch_dtype, logged by hf.load_hf
  cfg, _, _ = checkpoint.load_model(str(files["hf-bf16"]))
  if cfg.precision != "bfloat16" or lines != [
      f"{files['hf-bf16']}: bfloat16 weights (torch_dtype) -> bfloat16 (pass --dtype to choose)"]:
    bad.append(f"hf-bf16: {cfg.precision}, logged {lines}")
  return bad


def choice_mismatches(files, monkeypatch) -> list[str]:
  """CHOICES whose default_dtype differs, or whose log line does not name
  the file, its type, the precision and (but for F32/F16) the backend."""
  bad = []
  for kind, backend, share, want in CHOICES:
    reader = gguf_file.open_reader(files[kind])
    f32_bytes = 4 * sum(int(t.n_elements) for t in reader.tensors)
    lines = _logged(monkeypatch, gguf_weights, "warning")
    got = gguf_weights.default_dtype(reader, str(files[kind]), backend, int(share * f32_bytes))
    head = f"{files[kind]}: {kind} weights -> {want} ("
    named = kind in ("F32", "F16") or f"({backend}: " in (lines or [""])[0]
    if got != want or len(lines) != 1 or not lines[0].startswith(head) or not named:
      bad.append(f"{kind} on {backend} at {share}x: {got}, logged {lines}")
  return bad


def test_default_precision_follows_the_file_backend_and_size(files, monkeypatch):
  """F32 and F16 load as float32 (exact; F16 to bf16 would drop 3 mantissa
  bits); BF16 and quantized files as float32 on the CPU where they fit,
  bf16-mixed where not, bfloat16 on an accelerator; an HF directory in its
  torch_dtype; and the log says which and why."""
  assert default_mismatches(files, monkeypatch) + choice_mismatches(files, monkeypatch) == []


def _f16_as_bf16(monkeypatch):
  monkeypatch.setattr(gguf_weights, "FLOAT32_DEFAULT", ("F32",))


def _with(**fixed):
  """default_dtype with some of its arguments forced (a deliberate bug)."""
  def patch(monkeypatch, real=gguf_weights.default_dtype):
    def dtype(reader, source, backend=None, memory=None):
      args = {"reader": reader, "source": source, "backend": backend, "memory": memory, **fixed}
      return real(**args)
    monkeypatch.setattr(gguf_weights, "default_dtype", dtype)
  return patch


DEFAULT_MUTATIONS = {
    "every file float32 (the loader before)": lambda mp: mp.setattr(
        gguf_weights, "default_dtype", lambda reader, source, *a, **k: "float32"),
    "bfloat16 for BF16 and quantized files on every backend (the default before)":
        _with(backend="gpu"),
    "the size ignored on the CPU": _with(memory=1 << 62),
    "F16 defaults to bf16": _f16_as_bf16,
    "log line without the file's name": _with(source=""),
}


@pytest.mark.parametrize("bug", list(DEFAULT_MUTATIONS))
def test_each_default_bug_is_caught(files, monkeypatch, bug):
  DEFAULT_MUTATIONS[bug](monkeypatch)
  assert default_mismatches(files, monkeypatch) + choice_mismatches(files, monkeypatch)


def test_machine_memory_is_known_here():
  assert gguf_weights.machine_memory() > 0

# ------------------------------------------------------------ a whole run's memory


def run_bytes(cfg, params) -> int:
  """What a short run holds at its peak by XLA's own account: the params and
  a cache (the programs' arguments) plus the larger of the prefill's and the
  decode loop's temporaries, where XLA:CPU keeps float32 copies of bf16
  weights (the load alone does not show them)."""
  m = steps.Runner(cfg, params)
  cache = m.new_cache(1, 32)
  prefill = steps.prefill_step.lower(params, jnp.zeros((1, 16), jnp.int32),
                                     jnp.array([5], jnp.int32), cache, cfg=cfg)
  decode = generation.decode_loop.lower(
      params, jnp.zeros((1, cfg.padded_vocab), jnp.float32), cache, jax.random.PRNGKey(0),
      cfg=cfg, sp=SamplingParams(), n_predict=2, eos_id=-1)
  stats = [x.compile().memory_analysis() for x in (prefill, decode)]
  return (max(s.argument_size_in_bytes for s in stats)
          + max(s.temp_size_in_bytes for s in stats))


def run_mismatches(files) -> list[str]:
  """The CPU default of a quantized file must not hold more over a run than
  float32 does, and bf16-mixed (the default past the memory share) less."""
  path = files["Q8_0"]
  f32 = run_bytes(*gguf_weights.load_gguf(path, "float32")[:2])
  default = run_bytes(*gguf_weights.load_gguf(path)[:2])
  mixed = run_bytes(*gguf_weights.load_gguf(path, "bf16-mixed")[:2])
  bad = [f"default {default} B > float32 {f32} B"] if default > f32 else []
  return bad + ([f"bf16-mixed {mixed} B >= float32 {f32} B"] if mixed >= f32 else [])


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU default")
def test_cpu_default_holds_no_more_than_float32_over_a_run(files, monkeypatch):
  assert run_mismatches(files) == []
  _with(backend="gpu")(monkeypatch)  # the default before: bfloat16, whose copies show
  assert run_mismatches(files)

# ------------------------------------------------------------ never the float32 model


def live_float32_peak(monkeypatch, load) -> int:
  """The most bytes of dequantized float32 arrays (gguf.dequantize's
  results) alive at once during load()."""
  live, peak = [0], [0]
  real = gguf_file.dequantize

  def tracked(t, rows=slice(None)):
    out = real(t, rows)
    live[0] += out.nbytes
    peak[0] = max(peak[0], live[0])
    weakref.finalize(out, lambda n=out.nbytes: live.__setitem__(0, live[0] - n))
    return out
  monkeypatch.setattr(gguf_file, "dequantize", tracked)
  load()
  return peak[0]


def _read_everything_first(monkeypatch):
  real = hf.hf_state_to_params
  monkeypatch.setattr(hf, "hf_state_to_params", lambda cfg, state, **kw: real(
      cfg, {name: state[name] for name in state}, **kw))


HOST_MUTATIONS = {
    # the int8 loader before: the float32 model first, then quantized
    "every tensor read before any is converted": _read_everything_first,
    "each tensor read whole": lambda mp: mp.setattr(convert, "CHUNK_BYTES", 1 << 40),
}


def float32_peak(files, monkeypatch, dtype: str, bug=None) -> int:
  """live_float32_peak of loading the Q8_0 file at `dtype` in SMALL_CHUNK
  blocks, under HOST_MUTATIONS[bug] if given."""
  monkeypatch.setattr(convert, "CHUNK_BYTES", SMALL_CHUNK)
  if bug is not None:
    HOST_MUTATIONS[bug](monkeypatch)
  return live_float32_peak(
      monkeypatch, lambda: gguf_weights.load_gguf(files["Q8_0"], dtype))


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_never_more_than_a_block_of_float32(files, monkeypatch, dtype):
  """A Q8_0 file loaded as bf16 or int8 holds at most one block of rows as
  float32 at a time (the whole model is ~150 KB of float32 here)."""
  assert float32_peak(files, monkeypatch, dtype) <= SMALL_CHUNK


@pytest.mark.parametrize("bug", list(HOST_MUTATIONS))
def test_each_host_memory_bug_is_caught(files, monkeypatch, bug):
  """Reading the whole float32 model first, or whole tensors: over a block."""
  assert float32_peak(files, monkeypatch, "int8", bug) > 4 * SMALL_CHUNK
