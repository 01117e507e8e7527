"""Runs a specjax script as N processes on this machine, joined by
jax.distributed (CPU collectives over gloo): multi-host runs, tried locally.

  python -m specjax.parallel.launch --num_processes=2 --devices_per_process=4 -- \\
      experiments/speculative.py --mesh=data:1,model:8 --model=... --model_draft=...

Each process gets SPECJAX_COORDINATOR (localhost and a free port),
SPECJAX_NUM_PROCESSES and SPECJAX_PROCESS_ID, which the scripts read
(specjax.cli.setup_devices -> sharding.initialize_distributed); on a real
cluster set the same variables (or pass --coordinator_address, --num_processes,
--process_id) on each host instead. Process 0's output is passed through; the
others print nothing, and their stderr is shown only if they fail. If one
process fails or the --timeout passes, all are stopped and the exit status is
non-zero.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def launch(script_args: list[str], num_processes: int, devices_per_process: int | None = None,
           timeout: float = 600.0, port: int | None = None) -> int:
  """Starts the processes, waits for all; returns the exit status (0: all ok)."""
  if num_processes < 1:
    raise ValueError(f"--num_processes must be >= 1, got {num_processes}")
  if not script_args:
    raise ValueError("no script given: python -m specjax.parallel.launch [flags] -- script.py [args]")
  coordinator = f"localhost:{port or free_port()}"
  procs, logs = [], []
  for i in range(num_processes):
    env = dict(os.environ, SPECJAX_COORDINATOR=coordinator,
               SPECJAX_NUM_PROCESSES=str(num_processes), SPECJAX_PROCESS_ID=str(i))
    if devices_per_process:
      flags = [f for f in env.get("XLA_FLAGS", "").split()
               if not f.startswith("--xla_force_host_platform_device_count")]
      env["XLA_FLAGS"] = " ".join(
          flags + [f"--xla_force_host_platform_device_count={devices_per_process}"])
      env.setdefault("JAX_PLATFORMS", "cpu")
    cmd = [sys.executable] + list(script_args)  # script.py args, or -m module args
    log = None if i == 0 else tempfile.TemporaryFile(mode="w+")
    procs.append(subprocess.Popen(cmd, env=env, stderr=log, stdout=None if i == 0
                                  else subprocess.DEVNULL))
    logs.append(log)
  deadline = time.monotonic() + timeout
  status = 0
  try:
    while any(p.poll() is None for p in procs):
      failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
      if failed or time.monotonic() > deadline:
        status = procs[failed[0]].returncode if failed else 124
        why = (f"process {failed[0]} exited with status {status}" if failed
               else f"timed out after {timeout:.0f} s")
        print(f"error: {why}; stopping the others", file=sys.stderr)
        break
      time.sleep(0.1)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.wait()
  for i, (p, log) in enumerate(zip(procs, logs)):
    if p.returncode and log is not None:
      log.seek(0)
      tail = log.read()[-4000:]
      print(f"--- process {i} (status {p.returncode}) stderr:\n{tail}", file=sys.stderr)
    status = status or p.returncode
    if log is not None:
      log.close()
  return status


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if "--" in argv:
    i = argv.index("--")
    own, script = argv[:i], argv[i + 1:]
  else:
    own, script = argv, []
  ap = argparse.ArgumentParser(prog="python -m specjax.parallel.launch", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--num_processes", type=int, default=2)
  ap.add_argument("--devices_per_process", type=int, default=None,
                  help="CPU only: virtual devices per process "
                       "(--xla_force_host_platform_device_count)")
  ap.add_argument("--timeout", type=float, default=600.0, help="seconds before all are stopped")
  ap.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
  args = ap.parse_args(own)
  try:
    return launch(script, args.num_processes, args.devices_per_process, args.timeout, args.port)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
