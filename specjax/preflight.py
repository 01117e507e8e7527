"""What a script checks before its work, and how an error reaches the user.

cli.run calls these between flag parsing and `main`, so that a mistake
costs a second, not a run:
  config files   ml_collections reports a config's mistakes as tracebacks
                 (an unknown variant, an override of a field the config
                 lacks such as --config.gamma, a missing file: 10-55 lines);
                 `config_error_line` and `check_config_flags` say each in one.
  output paths   every flag named in OUTPUT_FILES / OUTPUT_DIRS that a script
                 defines is checked with workdir.check_output_file /
                 check_output_dir: a --json_out that is a directory, a
                 --workdir that is a file or read-only fails at the start,
                 not after the whole run.
  OSError        whatever still reaches the script prints as one line
                 (`os_error_line`), not a traceback.
"""

from __future__ import annotations

import re
import traceback

from absl import flags
from ml_collections import config_flags

from specjax import workdir as wd
from specjax.errors import ConfigError

def _last_line(text: str) -> str:
  lines = [l.strip() for l in str(text).splitlines() if l.strip()]
  return lines[-1] if lines else ""


def config_error_line(e: Exception, argv: list[str]) -> str | None:
  """A config file's error during flag parsing as one line; None when `e`
  did not come from ml_collections. Its ValueError / TypeError arrive inside
  absl's flag error as a whole traceback (the last line is the config's own
  message); an override of a field the config lacks arrives as a bare
  AttributeError / KeyError holding the key and a did-you-mean."""
  if isinstance(e, flags.Error):
    text = str(e)
    if "Traceback (most recent call last)" not in text:
      return None
    return f"{text.split(': Error whilst parsing', 1)[0]}: {_last_line(text)}"
  if not any("ml_collections" in f.filename for f in traceback.extract_tb(e.__traceback__)):
    return None
  text = str(e).replace("\\n", "\n")
  names = re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text)
  overrides = [a.split("=", 1)[0] for a in argv[1:] if re.match(r"--?\w+\.", a)]
  hit = [a for a in overrides if names and names[0] in re.split(r"[.\[\]]", a)]
  if isinstance(e, (AttributeError, KeyError)) and hit:
    hint = re.search(r'Did you mean "([^"]+)"', text)
    return (f"{hit[0]}: the config has no field {names[0]!r}"
            + (f" (did you mean {hint.group(1)!r}?)" if hint else ""))
  return f"config: {type(e).__name__}: {' '.join(text.split())}"


def check_config_flags() -> None:
  """A config file that failed to load (missing, unreadable) reaches the
  script as a value that raises on first use: refuse it now, in one line."""
  for name in list(flags.FLAGS):
    try:
      config_flags.get_config_filename(flags.FLAGS[name])
    except (TypeError, config_flags.config_flags.UnparsedFlagError):
      continue  # not a config flag
    try:
      getattr(flags.FLAGS[name].value, "keys", None)
    except OSError as e:
      raise ConfigError(f"--{name}={config_flags.get_config_filename(flags.FLAGS[name])}: "
                        f"{_last_line(str(e))}") from None


# Output flags, by name: checked before the work by `run` in every script
# that defines them (a path the run cannot write fails now, not at the end).
OUTPUT_FILES = ("json_out", "jsonl_out", "plot")
OUTPUT_DIRS = ("workdir", "out_dir", "export_dir", "dir")


def check_output_flags() -> None:
  """OUTPUT_FILES and OUTPUT_DIRS given on this script's command line (or by
  default), each through workdir.check_output_file / check_output_dir."""
  for name in OUTPUT_FILES + OUTPUT_DIRS:
    if name in flags.FLAGS and flags.FLAGS[name].value is not None:
      check = wd.check_output_file if name in OUTPUT_FILES else wd.check_output_dir
      check(flags.FLAGS[name].value, f"--{name}")


def os_error_line(e: OSError) -> str:
  """An OSError that reached the script: what failed, on which path."""
  if e.strerror and e.filename is not None:
    return f"{e.strerror}: {e.filename}" + (f" -> {e.filename2}" if e.filename2 else "")
  return " ".join(str(e).split()) or type(e).__name__
