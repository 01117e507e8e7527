"""A run's folder and its records: the one place that writes and reads them.

Every script that takes `--workdir` (or `--json_out`) follows these
conventions, and nothing else in specjax opens these files: results.jsonl
(one record per finished point, appended and flushed as it finishes; a line
torn by an interruption is skipped by `read_jsonl` and cut by
`restart_jsonl`), results.csv, config.json (the settings and
`environment()`), plots (`save_figure`) and summary.md. Invariants: nothing
finished is lost to an interruption; an output path that cannot be written
is refused before the work (`check_output_file`, `check_output_dir`); a
resumable stage's outputs are reused only for the settings they were made
with (`check_stage`). The files, and what `environment()` records:
docs/scripts.md, "A run's folder".
"""

from __future__ import annotations

import csv
import functools
import json
import os
import platform
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from specjax.errors import ConfigError, OutputError

Record = dict[str, Any]

RESULTS = "results.jsonl"
CSV_FILE = "results.csv"
CONFIG = "config.json"
SUMMARY = "summary.md"

# ---------------------------------------------------------------- JSON


def json_default(x):
  """json.dump's default= for numpy / jax values (and tuples of them)."""
  if hasattr(x, "tolist"):
    return x.tolist()
  if hasattr(x, "item"):
    return x.item()
  raise TypeError(f"not JSON serialisable: {type(x)}")


def _parent(path: str | os.PathLike) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)


def writes() -> bool:
  """Only process 0 of a multi-process run writes outputs (every process
  computes the same records)."""
  import jax  # pylint: disable=import-outside-toplevel
  return jax.process_index() == 0


def write_json(path: str | os.PathLike, obj: Any) -> None:
  """Writes obj as indented JSON, creating the parent folder."""
  if not writes():
    return
  _parent(path)
  with open(path, "w") as f:
    json.dump(obj, f, indent=1, default=json_default)
    f.write("\n")


def read_json(path: str | os.PathLike) -> Any:
  with open(path) as f:
    return json.load(f)


def append_jsonl(path: str | os.PathLike, records: Iterable[Record]) -> None:
  """Appends one JSON object per line (folder created), flushed at once."""
  if not writes():
    return
  _parent(path)
  with open(path, "a") as f:
    for r in records:
      f.write(json.dumps(r, default=json_default) + "\n")
    f.flush()


def read_jsonl(path: str | os.PathLike) -> list[Record]:
  """The whole records of a JSONL file; a torn or corrupt line is skipped.
  A missing file has no records."""
  if not os.path.exists(path):
    return []
  out = []
  with open(path) as f:
    for line in f:
      try:
        rec = json.loads(line)
      except ValueError:
        continue
      if isinstance(rec, dict):
        out.append(rec)
  return out


def restart_jsonl(path: str | os.PathLike, records: Sequence[Record]) -> None:
  """Rewrites `path` with exactly `records` (whole lines only)."""
  if not writes():
    return
  _parent(path)
  with open(path, "w") as f:
    f.writelines(json.dumps(r, default=json_default) + "\n" for r in records)


def normalised(obj: Any) -> Any:
  """obj as it reads back from JSON (tuples -> lists, numpy -> Python), so a
  settings dict can be compared with one read from config.json."""
  return json.loads(json.dumps(obj, default=json_default))

# ---------------------------------------------------------------- CSV


def csv_cell(v: Any) -> Any:
  """Floats with 6 significant digits, None as an empty cell."""
  if v is None:
    return ""
  return f"{v:.6g}" if isinstance(v, float) else v


def write_csv(path: str | os.PathLike, records: Sequence[Record],
              columns: Sequence[str],
              row: Callable[[Record], Record] | None = None) -> None:
  """One row per record under `columns` (missing fields empty, extra ones
  left out); `row` maps a record to its cells first (units, renames)."""
  if not writes():
    return
  _parent(path)
  with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
    w.writeheader()
    for r in records:
      cells = row(r) if row else r
      w.writerow({k: csv_cell(cells.get(k)) for k in columns})

# ---------------------------------------------------------------- config


def write_config(workdir: str | os.PathLike, config: Any, env: Record | None = None,
                 **extra: Any) -> None:
  """config.json: {"config": config, "env": env, **extra}."""
  write_json(os.path.join(workdir, CONFIG), {"config": config, "env": env, **extra})


def read_config(workdir: str | os.PathLike) -> Record | None:
  """config.json of a workdir, or None when it is missing or unreadable."""
  try:
    return read_json(os.path.join(workdir, CONFIG))
  except (OSError, ValueError):
    return None

# ---------------------------------------------------------------- output paths


def _writable_folder(folder: Path, what: str) -> None:
  """Raises OutputError unless `folder`, or the nearest existing folder
  above it (where the run would create it), is a folder that takes a new
  file (probed with a temporary file, removed at once)."""
  existing = folder
  while not existing.exists() and existing != existing.parent:
    existing = existing.parent
  if not existing.is_dir():
    raise OutputError(f"{what}: {existing} is a file, not a folder")
  try:
    with tempfile.TemporaryFile(dir=existing):
      pass
  except OSError as e:
    raise OutputError(f"{what}: cannot write in {existing} ({e.strerror})") from None


def check_output_file(path: str | os.PathLike, what: str) -> None:
  """Refuses now (OutputError, one line) a file the run would fail to write
  at its end: an empty path, a directory, a path through a file, or an
  unwritable file or folder. Creates nothing; an existing file is only
  opened for appending, its content untouched. `what` names the flag."""
  if not str(path).strip():
    raise OutputError(f"{what} is empty")
  p = Path(path).absolute()
  if p.is_dir():
    raise OutputError(f"{what} {path} is a directory; give a file name")
  if p.exists():
    try:
      with open(p, "a"):
        pass
    except OSError as e:
      raise OutputError(f"{what} {path} cannot be written ({e.strerror})") from None
    return
  _writable_folder(p.parent, f"{what} {path}")


def check_output_dir(path: str | os.PathLike, what: str) -> None:
  """Refuses now (OutputError, one line) a folder the run could not write
  into: an empty path, a file, a path through a file, or no write access.
  Creates nothing."""
  if not str(path).strip():
    raise OutputError(f"{what} is empty")
  p = Path(path).absolute()
  if p.exists() and not p.is_dir():
    raise OutputError(f"{what} {path} is a file, not a folder")
  _writable_folder(p, f"{what} {path}")

# ---------------------------------------------------------------- a stage's settings


def first_difference(have: Any, want: Any, name: str = "") -> str | None:
  """The first setting where two settings trees differ, as
  "name: have -> want" (nested keys joined by dots); None when equal.
  Compared as they read back from JSON (`normalised`)."""
  have, want = normalised(have), normalised(want)
  if isinstance(have, dict) and isinstance(want, dict):
    for k in list(want) + [k for k in have if k not in want]:
      sub = f"{name}.{k}" if name else str(k)
      if k not in have or k not in want:
        return f"{sub}: {have.get(k, '(absent)')} -> {want.get(k, '(absent)')}"
      diff = first_difference(have[k], want[k], sub)
      if diff:
        return diff
    return None
  return None if have == want else f"{name or 'settings'}: {have} -> {want}"


def check_stage(record: str | os.PathLike, want: Record,
                outputs: Sequence[str | os.PathLike], fix: str) -> bool:
  """Whether a resumable stage's `outputs` can be reused.

  `want` is everything the outputs depend on; `record` the JSON file that
  keeps it. All outputs present: reused (True) when the record holds `want`,
  refused otherwise (ConfigError naming the first difference, or the missing
  record of an older run, and `fix`): results are never reused for other
  settings, nor silently overwritten. An output missing: `want` is recorded
  and the stage runs (False).
  """
  record = Path(record)
  if all(Path(o).exists() for o in outputs):
    if not record.is_file():
      raise ConfigError(f"{Path(outputs[0])} was made by an older specjax that did not "
                        f"record its settings ({record.name}), so they cannot be checked; "
                        f"{fix}")
    diff = first_difference(read_json(record), want)
    if diff is None:
      return True
    raise ConfigError(f"{Path(outputs[0])} was made with other settings ({diff}); {fix}")
  write_json(record, want)
  return False

# ---------------------------------------------------------------- environment


@functools.cache
def git_commit() -> str:
  """The short commit of the specjax checkout, '+dirty' if it has changes,
  read once per process: a long run names the code it started with, not a
  commit made while it ran."""
  here = os.path.dirname(os.path.abspath(__file__))
  try:
    run = lambda *a: subprocess.run(["git", *a], cwd=here, capture_output=True,
                                    text=True, timeout=5).stdout.strip()
    commit = run("rev-parse", "--short", "HEAD")
    if not commit:
      return "unknown"
    dirty = run("status", "--porcelain", "--untracked-files=no", "--", ".")
    return commit + ("+dirty" if dirty else "")
  except (OSError, subprocess.SubprocessError):
    return "unknown"


# The CPU features that decide which kernels XLA:CPU and llama.cpp run.
VECTOR_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile",
                "amx_bf16", "amx_int8", "asimd", "sve", "sve2", "bf16", "i8mm")


def cpu_info() -> Record:
  """{"model": the CPU's model string, "flags": its vector extensions}
  (from /proc/cpuinfo on Linux; platform.processor() elsewhere)."""
  model, flags = "", set()
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Processor", "cpu model") and not model:
          model = value.strip()
        elif key in ("flags", "Features") and not flags:
          flags = set(value.split())
  except OSError:
    pass
  model = model or platform.processor() or platform.machine()
  return {"model": model, "flags": [f for f in VECTOR_FLAGS if f in flags]}


def cpu_line(env: Record) -> str:
  """'AMD EPYC 7B13 (avx2, fma, ...), 2 cores' for tables and summaries."""
  cpu = env.get("cpu") or {}
  flags = ", ".join(cpu.get("flags") or []) or "flags unknown"
  return f"{cpu.get('model', 'CPU unknown')} ({flags}), {env.get('cpu_count', '?')} cores"


def load_avg() -> list[float] | None:
  """Host load average (1, 5, 15 min): other work on the machine shows up in
  the timings, so every record says how busy it was."""
  try:
    return list(os.getloadavg())
  except OSError:
    return None


def environment() -> Record:
  """What every record carries: versions, backend, device, CPU, host, load."""
  import jax  # pylint: disable=import-outside-toplevel
  import jaxlib  # pylint: disable=import-outside-toplevel
  from specjax.model import sharding  # pylint: disable=import-outside-toplevel
  dev = jax.devices()[0]
  return {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
          "backend": jax.default_backend(), "device_kind": dev.device_kind,
          "n_devices": jax.device_count(), "n_processes": jax.process_count(),
          "mesh": str(sharding.mesh_shape(sharding.current())),
          "draft_sharding": sharding.draft_mode(), "host": platform.node(),
          "cpu": cpu_info(), "cpu_count": os.cpu_count(), "load_avg": load_avg(),
          "xla_flags": os.environ.get("XLA_FLAGS", ""), "git_commit": git_commit()}


def machine_line(env: Record) -> str:
  """One line naming the machine and commit a result came from."""
  dev = "" if env.get("backend") == "cpu" else f"{env.get('device_kind')}, "
  return (f"{dev}{cpu_line(env)}; jax {env.get('jax')} ({env.get('backend')}); "
          f"commit {env.get('git_commit')}")

# ---------------------------------------------------------------- plots


def pyplot():
  """matplotlib.pyplot on the file-only Agg backend (imported on first use)."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  return plt


def save_figure(fig, path: str | os.PathLike, dpi: int = 120) -> None:
  """Tight layout, written to `path`, closed."""
  if not writes():
    pyplot().close(fig)
    return
  fig.tight_layout()
  _parent(path)
  fig.savefig(path, dpi=dpi)
  pyplot().close(fig)
