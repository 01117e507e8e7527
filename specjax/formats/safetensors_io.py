"""safetensors files read and written with numpy alone: the header parsed by
hand, tensors memory-mapped and read one at a time (or one block of rows, for
a device's shard), bf16 through ml_dtypes. `SafetensorsState` maps tensor
names to lazily read arrays across a sharded checkpoint's files."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from specjax.errors import CheckpointError


# safetensors dtype names; BF16 through ml_dtypes, which plain numpy lacks.
_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
              "BF16": ml_dtypes.bfloat16, "I64": np.int64, "I32": np.int32,
              "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}


def raw_header(file: Path) -> tuple[np.ndarray, int, dict[str, Any]]:
  """(memory-mapped bytes, data offset, header) of a safetensors file, parsed
  by hand: 8-byte little-endian header size, JSON header, then the data."""
  if file.stat().st_size < 8:
    raise ValueError("file shorter than the 8-byte header size")
  data = np.memmap(file, dtype=np.uint8, mode="r")
  n = int.from_bytes(data[:8].tobytes(), "little")
  if 8 + n > data.size:
    raise ValueError("header runs past the end of the file")
  header = json.loads(data[8:8 + n].tobytes())
  header.pop("__metadata__", None)
  if max((i["data_offsets"][1] for i in header.values()), default=0) > data.size - 8 - n:
    raise ValueError("tensor data runs past the end of the file")
  return data, 8 + n, header


def read_raw(file: Path, names=None) -> dict[str, np.ndarray]:
  """Tensors `names` (default: all) of a safetensors file, parsed by hand: the
  fallback for safetensors versions whose numpy backend cannot do bf16."""
  data, base, header = raw_header(file)
  out = {}
  for name in header if names is None else names:
    start, end = (base + o for o in header[name]["data_offsets"])
    dt = np.dtype(_ST_DTYPES[header[name]["dtype"]])
    out[name] = np.array(data[start:end].view(dt).reshape(header[name]["shape"]))
  return out


def write_raw(file: Path, tensors: dict[str, np.ndarray],
               metadata: dict[str, str]) -> None:
  """Writes a safetensors file by hand (the fallback of `write_safetensors`)."""
  header: dict[str, Any] = {"__metadata__": metadata}
  offset = 0
  for name, arr in tensors.items():
    header[name] = {"dtype": _ST_NAMES[arr.dtype], "shape": list(arr.shape),
                    "data_offsets": [offset, offset + arr.nbytes]}
    offset += arr.nbytes
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
  with open(file, "wb") as fh:
    fh.write(len(blob).to_bytes(8, "little"))
    fh.write(blob)
    for arr in tensors.values():
      fh.write(np.ascontiguousarray(arr).tobytes())


def corrupt(file: Path, e: Exception) -> CheckpointError:
  """The error for a file neither safetensors nor the hand parser can read;
  the hand parser's reason is the plainer one."""
  msg = (str(e).strip().splitlines() or [repr(e)])[0]
  return CheckpointError(f"corrupt or unreadable safetensors file {file}: {msg}")


def tensor_names(file: Path) -> list[str]:
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  if not file.is_file():
    raise CheckpointError(f"missing weights file {file}")
  try:
    with safe_open(str(file), framework="np") as fh:
      return list(fh.keys())
  except Exception as first:  # pylint: disable=broad-except
    try:
      return list(raw_header(file)[2])
    except Exception as e:  # pylint: disable=broad-except
      raise corrupt(file, e) from first


def read_tensor(file: Path, name: str) -> np.ndarray:
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  try:
    with safe_open(str(file), framework="np") as fh:
      return fh.get_tensor(name)
  except Exception as first:  # pylint: disable=broad-except
    try:
      return read_raw(file, [name])[name]
    except Exception as e:  # pylint: disable=broad-except
      raise corrupt(file, e) from first


def tensor_shape(file: Path, name: str) -> tuple[int, ...]:
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  try:
    with safe_open(str(file), framework="np") as fh:
      return tuple(fh.get_slice(name).get_shape())
  except Exception as first:  # pylint: disable=broad-except
    try:
      return tuple(raw_header(file)[2][name]["shape"])
    except Exception as e:  # pylint: disable=broad-except
      raise corrupt(file, e) from first


def read_block(file: Path, name: str, index: tuple) -> np.ndarray:
  """tensor[index] through safe_open(...).get_slice (only that block is read);
  the hand parser's memory map where the numpy backend lacks the dtype."""
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  try:
    with safe_open(str(file), framework="np") as fh:
      return fh.get_slice(name)[index]
  except Exception as first:  # pylint: disable=broad-except
    try:
      data, base, header = raw_header(file)
      info = header[name]
      start, end = (base + o for o in info["data_offsets"])
      view = data[start:end].view(np.dtype(_ST_DTYPES[info["dtype"]]))
      return np.array(view.reshape(info["shape"])[index])
    except Exception as e:  # pylint: disable=broad-except
      raise corrupt(file, e) from first


class SafetensorsState(Mapping):
  """{HF name: numpy array} over safetensors files, each tensor read when it is
  accessed: loading then holds the params plus one tensor, not two copies of
  the model. bf16 comes as ml_dtypes.bfloat16.

  Raises:
    CheckpointError: a file is missing, truncated or not safetensors.
  """

  def __init__(self, files):
    self._file = {name: Path(f) for f in files for name in tensor_names(Path(f))}

  def __getitem__(self, name: str) -> np.ndarray:
    return read_tensor(self._file[name], name)

  def shape(self, name: str) -> tuple[int, ...]:
    """The tensor's shape, from the file header (nothing read)."""
    return tensor_shape(self._file[name], name)

  def read_block(self, name: str, index: tuple) -> np.ndarray:
    """tensor[index] (a tuple of slices), reading only that block."""
    return read_block(self._file[name], name, index)

  def __iter__(self):
    return iter(self._file)

  def __len__(self) -> int:
    return len(self._file)


def read_safetensors(file: str | os.PathLike) -> dict[str, np.ndarray]:
  """All tensors of one safetensors file as numpy arrays (bf16 via ml_dtypes)."""
  return dict(SafetensorsState([file]))


def write_safetensors(file: str | os.PathLike,
                      tensors: dict[str, np.ndarray]) -> None:
  """Writes numpy tensors (bf16 included) with HF's `format: pt` metadata,
  which transformers' from_pretrained requires."""
  import safetensors.numpy  # pylint: disable=import-outside-toplevel
  metadata = {"format": "pt"}
  try:
    safetensors.numpy.save_file(tensors, str(file), metadata=metadata)
  except Exception:  # pylint: disable=broad-except
    write_raw(Path(file), tensors, metadata)
