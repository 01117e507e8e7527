"""Script runs forked from one python that imported jax once, for the tests
of bad input (each such run is mostly importing jax: ~2 s of CPU saved a run).

A child is `python SCRIPT ARGS` as a user runs it: sys.argv, sys.path[0] the
script's folder, the same cwd and environment, its own stdout and stderr,
its exit status, an uncaught exception printed with its traceback (as Python
prints it), a run past `timeout` killed (and failing). The server never
starts a jax backend, so forking it is safe.
"""

import json
import os
import subprocess
import sys

SERVER = r"""
import json, os, runpy, signal, sys, traceback
import jax, absl.app, numpy
for line in sys.stdin:
  case = json.loads(line)
  pid = os.fork()
  if pid == 0:
    signal.alarm(case["timeout"])
    for fd, path in ((1, case["stdout"]), (2, case["stderr"])):
      os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.argv, sys.path[0] = [case["script"], *case["args"]], os.path.dirname(case["script"])
    code = 0
    try:
      runpy.run_path(case["script"], run_name="__main__")
    except SystemExit as e:
      code = e.code if isinstance(e.code, int) else (e.code is not None)
      if not isinstance(e.code, int) and e.code is not None:
        print(e.code, file=sys.stderr)
    except BaseException:
      traceback.print_exc()
      code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code))
  print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


class ForkRunner:
  """run(script_path, *args) -> subprocess.CompletedProcess, through SERVER."""

  def __init__(self, cwd: str, folder, timeout: int = 300):
    self.folder, self.timeout = folder, timeout
    self.server = subprocess.Popen([sys.executable, "-c", SERVER], cwd=cwd, text=True,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE)

  def run(self, script: str, *args: str, timeout: int | None = None
          ) -> subprocess.CompletedProcess:
    out, err = self.folder / "stdout", self.folder / "stderr"
    self.server.stdin.write(json.dumps({"script": script, "args": list(args),
                                        "stdout": str(out), "stderr": str(err),
                                        "timeout": timeout or self.timeout}) + "\n")
    self.server.stdin.flush()
    code = int(self.server.stdout.readline())
    return subprocess.CompletedProcess([script, *args], code, out.read_text(), err.read_text())

  def close(self) -> None:
    self.server.stdin.close()
    self.server.wait(timeout=60)
