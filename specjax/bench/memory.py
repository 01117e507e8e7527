"""The host's and the device's memory, for the runs that must fit in it: what
is available before a point starts (a point that would not fit is refused in
one line before it runs), and handing freed pages back between points.

A long sweep's resident memory grows with every point although its live
arrays do not (the :long_context sweep at 1 K: 3.2 GB of resident memory
after its first point, 4.2 GB after its fourth, the live arrays 1.2 GB
throughout): glibc keeps the freed caches' pages, and the next context's
larger caches come on top. `release_memory` returns them.
"""

from __future__ import annotations

import ctypes

import jax


def device_memory() -> dict[str, int]:
  """The default device's allocator figures (bytes_limit, bytes_in_use,
  peak_bytes_in_use, ...; {} on the CPU, whose arrays are the host's)."""
  return jax.devices()[0].memory_stats() or {}


def available_bytes() -> int | None:
  """The memory a point's arrays would take from: on an accelerator the
  default device's pool left (bytes_limit - bytes_in_use), on the CPU
  MemAvailable of /proc/meminfo (None where there is neither)."""
  stats = device_memory()
  if "bytes_limit" in stats:
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
  return _proc_bytes("/proc/meminfo", "MemAvailable")


def release_memory() -> None:
  """Hands the allocator's freed pages back to the system (glibc's
  malloc_trim), so a point's caches do not count against the next one."""
  try:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
  except (OSError, AttributeError):
    pass


def _proc_bytes(path: str, key: str) -> int | None:
  """A `key: N kB` figure of a /proc file in bytes (None where there is none)."""
  try:
    with open(path) as f:
      for line in f:
        if line.startswith(key + ":"):
          return int(line.split()[1]) * 1024
  except OSError:
    return None
  return None


def rss() -> int | None:
  """The process's resident memory now (VmRSS), bytes."""
  return _proc_bytes("/proc/self/status", "VmRSS")


def peak_rss() -> int | None:
  """The process's peak resident memory so far (VmHWM), bytes."""
  return _proc_bytes("/proc/self/status", "VmHWM")


def reset_peak() -> bool:
  """Resets the process's peak resident memory (VmHWM) to now; False where
  the kernel does not allow it (the peak is then the process's own)."""
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
    return True
  except OSError:
    return False
