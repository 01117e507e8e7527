"""Running past one device: the mesh (`data` rows x `model` tensor parallel),
the partition table, the active mesh and the multi-process set-up.

Params and caches carry `NamedSharding`s and jit's partitioner (GSPMD /
Shardy) splits the unchanged model code. `PARAM_SPECS` is the one place
that says how each weight is split (Megatron-style: q/k/v and gate/up on
their output columns, o and down on their input rows, two all-reduces per
layer; the embedding and LM head on the vocabulary, padded to the axis by
`pad_vocab`). The cache [B, K, S, D] splits on rows over `data` and on KV
heads over `model`: attention needs no communication. GQA with fewer KV
heads than the model axis is refused (`check_model`). `--draft_sharding`
auto splits a draft whose sizes allow it and replicates it otherwise.
`initialize_distributed` joins processes; only process 0 prints and writes.
Guide and measurements: docs/mesh.md; the table: ARCHITECTURE.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from typing import Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from specjax.model.config import ModelConfig
from specjax.errors import ConfigError

AXES = ("data", "model")
DRAFT_MODES = ("auto", "model", "replicated")

# Sampling draws the same bits whatever the sharding (and a prefix of the
# rows draws the same bits as the whole batch): the partitionable threefry.
# The default since jax 0.5; a jax that dropped the flag has it on for good.
try:
  jax.config.update("jax_threefry_partitionable", True)
except (AttributeError, KeyError):  # pragma: no cover - newer jax only
  pass

# (regex on the param path, spec). First match wins; every param must match.
PARAM_SPECS: tuple[tuple[str, P], ...] = (
    (r"(^|/)embed/embedding$", P("model", None)),            # [V, E]: vocab rows
    (r"/attn/w[qkv]/kernel$", P(None, "model")),             # [E, H*D]: heads
    (r"/attn/wo/kernel$", P("model", None)),                 # [H*D, E]: rows
    (r"/mlp/w_(gate|up)/kernel$", P(None, "model")),         # [E, F]: FFN columns
    (r"/mlp/w_down/kernel$", P("model", None)),              # [F, E]: rows
    (r"(^|/)lm_head/kernel$", P(None, "model")),             # [E, V]: vocab
    (r"(^|/|_)norm/scale$", P()),                            # norms: replicated
    # --dtype=int8 (quant.py): int8 kernels split as the float ones, and
    # each per-output-channel scale as the kernel's output columns.
    (r"/attn/w[qkv]/kernel_q$", P(None, "model")),
    (r"/attn/w[qkv]/kernel_scale$", P("model")),
    (r"/attn/wo/kernel_q$", P("model", None)),
    (r"/attn/wo/kernel_scale$", P()),
    (r"/mlp/w_(gate|up)/kernel_q$", P(None, "model")),
    (r"/mlp/w_(gate|up)/kernel_scale$", P("model")),
    (r"/mlp/w_down/kernel_q$", P("model", None)),
    (r"/mlp/w_down/kernel_scale$", P()),
    (r"(^|/)lm_head/kernel_q$", P(None, "model")),
    (r"(^|/)lm_head/kernel_scale$", P("model")),
)


@dataclasses.dataclass(frozen=True)
class MeshShape:
  data: int = 1
  model: int = 1

  @property
  def size(self) -> int:
    return self.data * self.model

  def __str__(self) -> str:
    return f"data:{self.data},model:{self.model}"


def parse_mesh(spec: str, n_devices: int) -> MeshShape:
  """'data:D,model:M' -> MeshShape. A missing axis is 1; -1 takes all the
  devices the other axis leaves. Raises ConfigError (one line) otherwise."""
  sizes = {}
  for part in [p for p in str(spec).replace(" ", "").split(",") if p]:
    name, _, value = part.partition(":")
    if name not in AXES or not value:
      raise ConfigError(f"--mesh={spec!r}: expected 'data:D,model:M' (axes "
                        f"{', '.join(AXES)}), got {part!r}")
    if name in sizes:
      raise ConfigError(f"--mesh={spec!r}: axis {name!r} given twice")
    try:
      sizes[name] = int(value)
    except ValueError:
      raise ConfigError(f"--mesh={spec!r}: size of {name!r} must be an integer, "
                        f"got {value!r}") from None
    if sizes[name] == 0 or sizes[name] < -1:
      raise ConfigError(f"--mesh={spec!r}: size of {name!r} must be positive "
                        f"(or -1 for all devices), got {sizes[name]}")
  if not sizes:
    raise ConfigError(f"--mesh={spec!r}: expected 'data:D,model:M'")
  wild = [a for a, s in sizes.items() if s == -1]
  if len(wild) > 1:
    raise ConfigError(f"--mesh={spec!r}: only one axis can be -1")
  fixed = int(np.prod([s for s in sizes.values() if s != -1]))
  if wild:
    if n_devices % fixed:
      raise ConfigError(f"--mesh={spec!r}: {n_devices} devices do not split "
                        f"evenly by {fixed}")
    sizes[wild[0]] = n_devices // fixed
  shape = MeshShape(**sizes)
  if shape.size > n_devices:
    raise ConfigError(f"--mesh={spec!r} needs {shape.size} devices "
                      f"({shape.data} x {shape.model}) but {n_devices} are available")
  return shape


def make_mesh(shape: MeshShape | str, devices=None) -> Mesh:
  """A ('data', 'model') Mesh over the first shape.size devices (all
  processes' devices, in jax.devices() order: process by process)."""
  devices = list(jax.devices() if devices is None else devices)
  if isinstance(shape, str):
    shape = parse_mesh(shape, len(devices))
  if jax.process_count() > 1 and shape.size != len(devices):
    raise ConfigError(f"--mesh={shape}: a multi-process run must use all "
                      f"{len(devices)} devices, the mesh has {shape.size}")
  grid = np.array(devices[:shape.size], dtype=object).reshape(shape.data, shape.model)
  return Mesh(grid, AXES)


def mesh_shape(mesh: Mesh | None) -> MeshShape:
  if mesh is None:
    return MeshShape()
  return MeshShape(mesh.shape["data"], mesh.shape["model"])


def check_model(cfg: ModelConfig, model_axis: int) -> None:
  """Raises ConfigError unless the model axis divides every split size (the
  vocabulary as padded: `pad_vocab`)."""
  if model_axis <= 1:
    return
  sizes = {"n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads,
           "ffn_dim": cfg.ffn_dim, "vocab_size": cfg.padded_vocab}
  bad = [f"{k}={v}" for k, v in sizes.items() if v % model_axis]
  if bad:
    hint = (" (KV heads are not replicated across the model axis: use a "
            "smaller model axis, or --draft_sharding=replicated for a draft)"
            if cfg.n_kv_heads % model_axis else "")
    raise ConfigError(f"{cfg.name}: the model axis ({model_axis} devices) does "
                      f"not divide {', '.join(bad)}{hint}")


def pad_vocab(cfg: ModelConfig, model_axis: int | None = None) -> ModelConfig:
  """`cfg` as it is loaded on a mesh of `model_axis` (default: the active
  mesh's): its vocabulary padded to a multiple of the axis when it does not
  divide it (vocab_multiple, see ModelConfig.padded_vocab), else unchanged
  (vocab_multiple 1). By the mesh, not the role: a replicated draft is padded
  like its target, so that the two distributions the acceptance test
  compares have the same width."""
  m = mesh_shape(current()).model if model_axis is None else model_axis
  return cfg.replace(vocab_multiple=m if cfg.vocab_size % m else 1)


# ------------------------------------------------------------- the active mesh

@dataclasses.dataclass
class _Active:
  mesh: Mesh | None = None
  draft_mode: str = "auto"


_ACTIVE = _Active()


def current() -> Mesh | None:
  """The mesh set by `activate` (None: plain single-device runs)."""
  return _ACTIVE.mesh


def draft_mode() -> str:
  return _ACTIVE.draft_mode


def activate(mesh: Mesh | None, draft: str = "auto") -> None:
  """Makes `mesh` the one every model load and cache uses (and jax's
  context mesh). None goes back to single-device runs."""
  if draft not in DRAFT_MODES:
    raise ConfigError(f"--draft_sharding must be one of {', '.join(DRAFT_MODES)}, "
                      f"got {draft!r}")
  _ACTIVE.mesh, _ACTIVE.draft_mode = mesh, draft
  if mesh is not None:
    jax.set_mesh(mesh)


@contextlib.contextmanager
def use(mesh: Mesh | None, draft: str = "auto"):
  """`activate` for a block (tests, notebooks)."""
  old = (_ACTIVE.mesh, _ACTIVE.draft_mode)
  _ACTIVE.mesh, _ACTIVE.draft_mode = mesh, draft
  try:
    if mesh is None:
      yield None
    else:
      with jax.set_mesh(mesh):
        yield mesh
  finally:
    _ACTIVE.mesh, _ACTIVE.draft_mode = old


def divides(cfg: ModelConfig, model_axis: int) -> bool:
  """True if `check_model(cfg, model_axis)` passes."""
  try:
    check_model(cfg, model_axis)
  except ConfigError:
    return False
  return True


def model_axis_for(role: str, cfg: ModelConfig | None = None) -> int:
  """The model-axis size a model of this role ('target' or 'draft') is split
  over. An 'auto' draft is split when `cfg` divides the axis."""
  mesh = current()
  if mesh is None:
    return 1
  m = mesh.shape["model"]
  if role == "draft":
    mode = draft_mode()
    if mode == "replicated" or (mode == "auto" and (cfg is None or not divides(cfg, m))):
      return 1
  return m


# --------------------------------------------------------------- param layout

def param_spec(path: str, split: bool = True) -> P:
  """The PartitionSpec of the param at `path` ('layers_0/attn/wq/kernel')."""
  for pattern, spec in PARAM_SPECS:
    if re.search(pattern, path):
      return spec if split else P()
  raise ConfigError(f"no partition spec for param {path!r} (see sharding.PARAM_SPECS)")


def path_str(path) -> str:
  return "/".join(str(getattr(k, "key", k)) for k in path)


def param_shardings(tree, mesh: Mesh, split: bool = True):
  """NamedShardings for a params tree (arrays or shapes), by name."""
  return jax.tree_util.tree_map_with_path(
      lambda p, _: NamedSharding(mesh, param_spec(path_str(p), split)), tree)


def role_shardings(cfg: ModelConfig, tree, role: str):
  """The shardings for a model of `role` on the active mesh (None: no mesh).
  Checks that the model axis divides the model's sizes."""
  mesh = current()
  if mesh is None:
    return None
  m = model_axis_for(role, cfg)
  check_model(cfg, m)
  return param_shardings(tree, mesh, split=m > 1)


def place(x, sharding: NamedSharding):
  """A host (numpy) array as a global jax.Array with `sharding`: every
  process builds only the shards of its own devices."""
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def place_params(params, shardings):
  """Places a params tree (host or device arrays) with `shardings`."""
  if shardings is None:
    return params
  return jax.tree_util.tree_map(
      lambda x, s: jax.device_put(x, s) if isinstance(x, jax.Array) and
      x.is_fully_addressable and jax.process_count() == 1 else place(x, s),
      params, shardings)


def from_slices(shape, dtype, sharding: NamedSharding,
                read: Callable[[tuple], np.ndarray]) -> jax.Array:
  """A global array whose shards are read one by one: read(index) returns the
  block at `index` (a tuple of slices), so a process never holds more than
  its own devices' blocks."""
  return jax.make_array_from_callback(
      tuple(shape), sharding, lambda idx: np.asarray(read(idx), dtype))


def is_split(params) -> bool:
  """True if `params` are split over a model axis (read from a k kernel)."""
  wk = params["layers_0"]["attn"]["wk"]
  leaf = wk["kernel"] if "kernel" in wk else wk["kernel_q"]
  spec = getattr(getattr(leaf, "sharding", None), "spec", None)
  return bool(spec) and "model" in tuple(spec)


def cache_sharding(params, batch: int) -> NamedSharding | None:
  """The NamedSharding of one [B, K, S, D] cache of the model with `params`:
  KV heads split like the params' k/v columns, rows over `data` when the data
  axis divides the batch (else replicated over it). None without a mesh."""
  mesh = current()
  if mesh is None:
    return None
  rows = "data" if batch % mesh.shape["data"] == 0 else None
  return NamedSharding(mesh, P(rows, "model" if is_split(params) else None, None, None))


def replicated() -> NamedSharding | None:
  mesh = current()
  return None if mesh is None else NamedSharding(mesh, P())


# ------------------------------------------------------------- multi-process

ENV = {"coordinator": "SPECJAX_COORDINATOR", "num_processes": "SPECJAX_NUM_PROCESSES",
       "process_id": "SPECJAX_PROCESS_ID"}


def initialize_distributed(coordinator: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None) -> bool:
  """jax.distributed.initialize from arguments or SPECJAX_* variables.

  Returns True if this is a multi-process run. On CPU the collectives go
  over gloo. Must run before any computation.
  """
  coordinator = coordinator or os.environ.get(ENV["coordinator"])

  def env_int(name: str) -> int:
    value = os.environ[ENV[name]]
    try:
      return int(value)
    except ValueError:
      raise ConfigError(f"{ENV[name]} must be an integer, got {value!r}") from None
  if num_processes is None and os.environ.get(ENV["num_processes"]):
    num_processes = env_int("num_processes")
  if process_id is None and os.environ.get(ENV["process_id"]):
    process_id = env_int("process_id")
  if not coordinator and num_processes in (None, 1):
    return False
  if not coordinator or num_processes is None or process_id is None:
    raise ConfigError("a multi-process run needs --coordinator_address, "
                      "--num_processes and --process_id (or the SPECJAX_COORDINATOR, "
                      "SPECJAX_NUM_PROCESSES, SPECJAX_PROCESS_ID variables)")
  if not 0 <= process_id < num_processes:
    raise ConfigError(f"--process_id={process_id} must lie in [0, {num_processes})")
  if jax.config.jax_platforms in (None, "", "cpu") or os.environ.get("JAX_PLATFORMS") == "cpu":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=coordinator,
                             num_processes=num_processes, process_id=process_id)
  return True


def is_main_process() -> bool:
  """Only process 0 prints results and writes files."""
  return jax.process_index() == 0


def to_host(x) -> np.ndarray:
  """A (possibly multi-process) array as numpy on every process."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    if x.is_fully_replicated:
      return np.asarray(x.addressable_data(0))
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)
