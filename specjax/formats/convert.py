"""Params built leaf by leaf from a lazily read checkpoint, within memory.

hf.hf_state_to_params (HF safetensors, GGUF through gguf_weights.GGUFState,
torch state dicts) places every tensor through `tensor_leaves`. Invariant:
no tensor is held twice and the float32 model is never held whole. A tensor
is read about CHUNK_BYTES of float32 rows at a time straight into a host
array of the load dtype (bf16 through ml_dtypes, rounding as XLA's cast
does; int8 kernels quantized per channel as their rows are read,
quant.quantize_rows); the page-aligned host array goes on device before the
next tensor is read, and a memory-mapped state drops the tensor's pages
(GGUFState.release, then `trim_heap`). On a mesh each device's block is read
on its own (jax.make_array_from_callback). The design and the peaks
measured: docs/gguf_int8.md, "Loading within memory".
"""

from __future__ import annotations

import ctypes
import mmap

import jax
import numpy as np

from specjax.model import quant

# float32 bytes read per block of rows (a 7B's 11008 x 4096 kernel: 22
# blocks); a block's conversion makes two or three temporaries its size.
CHUNK_BYTES = 8 << 20


def aligned_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
  """An uninitialised C-ordered array in its own anonymous memory map
  (page-aligned; unmapped when the last reference goes): the params' host
  arrays stay out of malloc's heap, where the freed float32 blocks between
  them would keep the process's resident size up after the load. Its pages
  are populated at once (MAP_POPULATE: half the time of faulting them in
  one by one as the blocks are written)."""
  dtype = np.dtype(dtype)
  n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  if n == 0:
    return np.empty(shape, dtype)
  flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
  return np.frombuffer(mmap.mmap(-1, n, flags=flags), dtype).reshape(shape)


def read(state, name: str, index: tuple) -> np.ndarray:
  """state[name][index] (torch layout), through `state.read_block` where
  the state has it (only that block is read)."""
  if hasattr(state, "read_block"):
    return np.asarray(state.read_block(name, index))
  return np.asarray(state[name])[index]


def read_padded(state, t, index: tuple, pad: int) -> np.ndarray:
  """state[t.hf_name][index] of the tensor with `pad` zero rows after its
  own (ModelConfig.padded_vocab): only the rows the file holds are read."""
  if not pad:
    return read(state, t.hf_name, index)
  n = t.hf_shape[0]
  start, stop, _ = index[0].indices(n + pad)  # a device's rows: a slice, step 1
  rest = index[1:]
  block = read(state, t.hf_name, (slice(min(start, n), min(stop, n)),) + rest) \
      if start < n else None
  if block is not None and block.shape[0] == stop - start:
    return block
  cols = tuple(len(range(*s.indices(d))) for s, d in zip(rest, t.hf_shape[1:]))
  zeros = np.zeros((stop - max(start, n),) + cols, np.float32)
  return zeros if block is None else np.concatenate([block, zeros.astype(block.dtype)])


def host_leaves(state, t, pad: int, dtype, quantize: bool) -> dict[str, np.ndarray]:
  """Tensor `t` (hf.tensor_map's entry) as host arrays in specjax's layout:
  {'kernel_q', 'kernel_scale'} when `quantize`, else {leaf name: array in
  `dtype`}; read CHUNK_BYTES of float32 rows at a time."""
  n, rest = t.hf_shape[0], tuple(t.hf_shape[1:])
  step = max(1, CHUNK_BYTES // (4 * max(1, int(np.prod(rest, dtype=np.int64)))))
  full = (n + pad,) + rest
  if quantize:  # [in, out]: a zero (padding) channel quantizes to 0, scale 1
    q, scale = aligned_empty(full[::-1], np.int8), aligned_empty((n + pad,), np.float32)
    q[:, n:], scale[n:] = 0, 1
  else:
    out = aligned_empty(full[::-1] if t.transpose else full, dtype)
    if t.transpose:
      out[:, n:] = 0
    else:
      out[n:] = 0
  for r0 in range(0, n, step):
    rows = slice(r0, min(n, r0 + step))
    block = read(state, t.hf_name, (rows,) + (slice(None),) * len(rest))  # [r, ...]
    if quantize:
      q[:, rows], scale[rows] = (x.T for x in quant.quantize_rows(block))
    elif t.transpose:
      out[:, rows] = block.T
    else:
      out[rows] = block
    del block
    if hasattr(state, "release"):
      state.release(t.hf_name)
  return {"kernel_q": q, "kernel_scale": scale} if quantize else {t.path[-1]: out}


def sharded_leaves(state, t, pad: int, dtype, quantize: bool, shardings) -> dict:
  """host_leaves as global arrays on a mesh, each device's block read on its
  own; `shardings`: the NamedShardings of the leaves' parent node."""
  n = t.hf_shape[0] + pad
  shape = (n,) + tuple(t.hf_shape[1:])
  shape = shape[::-1] if t.transpose else shape
  if not quantize:
    def block(index):  # index in specjax's layout; the file is in torch's
      hf_index = tuple(reversed(index)) if t.transpose else tuple(index)
      arr = read_padded(state, t, hf_index, pad)
      return np.ascontiguousarray(arr.T if t.transpose else arr, dtype)
    leaf = t.path[-1]
    return {leaf: jax.make_array_from_callback(shape, shardings[leaf], block)}
  rows_done: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

  def rows_q(rows: slice):  # a block of channels, quantized from whole rows
    key = rows.indices(n)
    if key not in rows_done:
      rows_done[key] = quant.quantize_rows(read_padded(state, t, (rows, slice(None)), pad))
    return rows_done[key]
  kernel = lambda index: np.ascontiguousarray(rows_q(index[1])[0][:, index[0]].T)
  scale = lambda index: rows_q(index[0])[1]
  return {"kernel_q": jax.make_array_from_callback(shape, shardings["kernel_q"], kernel),
          "kernel_scale": jax.make_array_from_callback((n,), shardings["kernel_scale"],
                                                       scale)}


def tensor_leaves(state, t, pad: int, dtype, quantize: bool, shardings=None) -> dict:
  """Tensor `t` of `state` as its params leaves on device ({leaf name:
  array}: one float leaf, or 'kernel_q' and 'kernel_scale' when `quantize`),
  on one device or (`shardings`: the parent node's NamedShardings) on the
  mesh; the host copy dropped and the file's pages released before return."""
  if shardings is None:
    out = {k: jax.device_put(v) for k, v in host_leaves(state, t, pad, dtype, quantize).items()}
  else:
    out = sharded_leaves(state, t, pad, dtype, quantize, shardings)
  jax.block_until_ready(out)
  if hasattr(state, "release"):
    state.release(t.hf_name)
  trim_heap()
  return out


def trim_heap() -> None:
  """Hands malloc's free heap back to the system (glibc's malloc_trim): the
  blocks' temporaries, freed between the params' arrays, would otherwise
  stay resident (about 60 MB after a llama-160m Q8_0 load). A no-op
  elsewhere."""
  global _LIBC  # pylint: disable=global-statement
  if _LIBC is None:
    try:
      _LIBC = ctypes.CDLL("libc.so.6")
      _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
    except (OSError, AttributeError):
      _LIBC = False
  if _LIBC:
    _LIBC.malloc_trim(0)


_LIBC = None
