"""Text helpers shared by the studies' reports and the scripts: integer lists
from flags, sizes and parameter counts for humans, markdown tables, a
model's size record."""

from __future__ import annotations
from typing import Iterable, Sequence
import jax
from specjax.model import llama as model_lib
from specjax.model.config import ModelConfig
from specjax.errors import ConfigError
from specjax.workdir import Record


def parse_ints(value: str | Sequence[int], name: str = "value",
               minimum: int = 1) -> list[int]:
  """'1,2,4' (or a list) -> [1, 2, 4]; each >= minimum."""
  items = value.split(",") if isinstance(value, str) else list(value)
  try:
    out = [int(str(v).strip()) for v in items if str(v).strip()]
  except ValueError:
    raise ConfigError(f"{name} must be comma-separated integers, "
                      f"got {value!r}") from None
  if not out:
    raise ConfigError(f"{name} is empty")
  bad = [v for v in out if v < minimum]
  if bad:
    raise ConfigError(f"{name} values must be >= {minimum}, got {bad}")
  return out


def format_size(nbytes: int) -> str:
  """Bytes as llama-bench prints model size: MiB below 1 GiB, else GiB."""
  if nbytes < 1024 ** 3:
    return f"{nbytes / 1024 ** 2:.2f} MiB"
  return f"{nbytes / 1024 ** 3:.2f} GiB"


def format_params(n: int) -> str:
  """Parameter count as llama-bench prints it: M below 1e9, else B."""
  return f"{n / 1e6:.2f} M" if n < 1e9 else f"{n / 1e9:.2f} B"


def markdown_table(columns: Sequence[str], rows: Iterable[Sequence[str]],
                   right: Sequence[bool] | None = None) -> str:
  """A markdown table, columns padded to their widest cell."""
  rows = [list(map(str, r)) for r in rows]
  right = right or [False] * len(columns)
  widths = [max([len(c)] + [len(r[i]) for r in rows])
            for i, c in enumerate(columns)]
  pad = lambda s, i: s.rjust(widths[i]) if right[i] else s.ljust(widths[i])
  line = lambda cells: "| " + " | ".join(pad(c, i) for i, c in enumerate(cells)) + " |"
  rule = "|" + "|".join(("-" * (w + 1) + ":") if r else ("-" * (w + 2))
                        for w, r in zip(widths, right)) + "|"
  return "\n".join([line(columns), rule] + [line(r) for r in rows])


def model_info(cfg: ModelConfig, params) -> Record:
  return {"model": cfg.name, "size_bytes": model_lib.param_bytes(params),
          "n_params": model_lib.param_count(params),
          "backend": jax.default_backend(), "dtype": cfg.precision}


# ----------------------------------------------------------------------------
# llama-bench: pp N and tg N at depth n_depth.
