"""Levers against a launch-bound draft on a GPU (issue 38, part 6): settings
that change how a step is compiled, never what it computes.

  command buffers  XLA records the step's kernels and loops as CUDA graphs
                   (COMMAND_BUFFER: compile options, or XLA_FLAGS)
  draft_scan       the draft's layers as one lax.scan (ModelConfig.scan_layers)
  fused / blocked  an attention kind instead of the backend's default

On the CPU every lever gives the same tokens (tests/model/test_levers.py);
what they buy is measured on a GPU (experiments/gpu_check.py; BUILD.md).
A process's lever is set at its edge (`activate`: cli's --lever), and
`checkpoint.load_model` applies it.
  XLA_FLAGS="$(python -m specjax.model.levers NAME)" python ... --lever=NAME
"""

from __future__ import annotations

import dataclasses
import sys

from specjax.errors import ConfigError
from specjax.model import config as config_lib

# XLA:GPU's command buffers: the command types recorded into CUDA graphs (the
# flag also takes +TYPE/-TYPE against XLA's default list) and the smallest
# graph worth recording (default 5 ops; a draft's small fusions qualify at 1).
COMMAND_BUFFER = {
    "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUDNN,CUSTOM_CALL,CONDITIONAL,WHILE",
    "xla_gpu_graph_min_graph_size": 1,
}


@dataclasses.dataclass(frozen=True)
class Lever:
  """One setting (or a combination): the attention kind to force (None: the
  backend's, config.for_backend), the draft's layers scanned, XLA's command
  buffers on."""
  name: str
  attention: str | None = None
  draft_scan: bool = False
  command_buffers: bool = False

  def model_config(self, cfg: config_lib.ModelConfig, role: str) -> config_lib.ModelConfig:
    """cfg under this lever (attention for both roles, the scan for a draft)."""
    if self.attention:
      cfg = cfg.replace(attention=self.attention)
    if self.draft_scan and role == "draft":
      cfg = cfg.replace(scan_layers=True)
    return cfg

  def compiler_options(self) -> dict:
    """jax's `compiler_options` (Lowered.compile, jax.jit) for this lever."""
    return dict(COMMAND_BUFFER) if self.command_buffers else {}

  def xla_flags(self) -> str:
    """The same options as XLA_FLAGS text, for a process started under them."""
    return " ".join(f"--{k}={v}" for k, v in self.compiler_options().items())

  def missing_flags(self, xla_flags: str) -> list[str]:
    """The flags of this lever that an XLA_FLAGS value lacks (a process whose
    backend started without them would measure the default silently)."""
    have = set(xla_flags.split())
    return [f for f in self.xla_flags().split() if f not in have]


LEVERS = {lv.name: lv for lv in (
    Lever("default"),
    Lever("blocked", attention="blocked"),  # the CPU's kind, on any backend
    Lever("masked", attention="masked"),
    Lever("fused", attention="fused"),
    Lever("draft_scan", draft_scan=True),
    Lever("command_buffers", command_buffers=True),
    Lever("all", attention="fused", draft_scan=True, command_buffers=True),
)}


def parse(name: str) -> Lever:
  """A lever by name (ConfigError, one line, naming the valid ones)."""
  if name not in LEVERS:
    raise ConfigError(f"unknown lever {name!r}; valid: {', '.join(LEVERS)}")
  return LEVERS[name]


_ACTIVE = [LEVERS["default"]]


def activate(lever: Lever) -> None:
  """Makes `lever` the process's: checkpoint.load_model applies it."""
  _ACTIVE[0] = lever


def active() -> Lever:
  return _ACTIVE[0]


def use(name: str, xla_flags: str) -> None:
  """Activates the lever `name` (cli's --lever) if the process's XLA_FLAGS
  hold its flags: XLA reads them once, when it starts, so a run without them
  would measure the default silently (ConfigError, one line, instead)."""
  lever = parse(name)
  missing = lever.missing_flags(xla_flags)
  if missing:
    raise ConfigError(f"--lever={name} needs XLA_FLAGS to hold {' '.join(missing)} when the "
                      f"process starts: XLA_FLAGS=\"$(python -m specjax.model.levers {name})\"")
  activate(lever)


def main(argv: list[str]) -> int:
  """`python -m specjax.model.levers NAME`: prints NAME's XLA_FLAGS."""
  if len(argv) != 2:
    print(f"usage: python -m specjax.model.levers NAME ({', '.join(LEVERS)})", file=sys.stderr)
    return 2
  try:
    print(parse(argv[1]).xla_flags())
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
