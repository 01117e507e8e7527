"""A sweep's workdir, checked before any work and never emptied by surprise.

`check` runs before the models load: the folder must take files; a workdir
that holds records is refused unless the run resumes it (what its records
depend on must be what config.json saved: the record schema, every setting
but those that only add points, and the machine: `check_same`) or replaces
it (`overwrite`). `claim` runs once everything else has been checked too:
with `overwrite`, the old outputs move aside into a folder of their own
(nothing is deleted); then results.jsonl keeps exactly the finished records
and config.json is written.
"""

from __future__ import annotations

import dataclasses
import datetime
import glob
import os
import shutil

from specjax import workdir as wd
from specjax.bench.sweep.config import SweepConfig
from specjax.errors import ConfigError, OutputError
from specjax.metrics import schema
from specjax.workdir import Record

# Settings that only add points: a resume may change them.
POINT_FIELDS = ("gammas", "accepts", "temps", "batches", "auto_gamma", "drafters", "trees",
                "noise_threshold", "row_budgets")
# What a sweep writes (besides its plots, *.png): moved aside together.
OUTPUTS = (wd.RESULTS, wd.CSV_FILE, wd.CONFIG, wd.SUMMARY, "costs.json", "noise.json",
           "verify_surface.csv")
MACHINE = ("backend", "device_kind", "n_devices", "cpu_count", "jax")


@dataclasses.dataclass
class Claim:
  """What `check` found: the finished records a resume keeps."""
  workdir: str
  done: list[Record]
  overwrite: bool
  outputs: tuple[str, ...]


def machine(env: Record) -> Record:
  """The part of the environment a measurement depends on."""
  return {**{k: env.get(k) for k in MACHINE}, "cpu": (env.get("cpu") or {}).get("model")}


def check(workdir: str, cfg: SweepConfig, env: Record, resume: bool, overwrite: bool,
          outputs: tuple[str, ...] = OUTPUTS) -> Claim:
  """Refuses (one line) a workdir the run must not write into; writes nothing."""
  wd.check_output_dir(workdir, "workdir")  # a file, no write access: one line now
  if resume and overwrite:
    raise ConfigError("--resume keeps a workdir's records and --overwrite moves them aside: "
                      "give one")
  done = wd.read_jsonl(os.path.join(workdir, wd.RESULTS))
  if done and not (resume or overwrite):
    raise OutputError(f"{workdir} holds {len(done)} record(s) of a sweep: pass --resume to "
                      "finish it, --overwrite to move them aside, or another --workdir")
  if done and resume:
    check_same(workdir, cfg, env)
  return Claim(workdir, done if resume else [], overwrite, outputs)


def check_same(workdir: str, cfg: SweepConfig, env: Record) -> None:
  """A resume into a workdir whose records were measured otherwise (other
  settings, another machine, an older record schema) is refused."""
  saved = wd.read_config(workdir)
  fix = "use another --workdir, the same config, or --overwrite"
  if saved is None:
    raise ConfigError(f"cannot resume: {workdir} holds records but no readable "
                      f"{wd.CONFIG} to check their settings; {fix}")
  if saved.get("schema") != schema.SCHEMA_VERSION:
    raise ConfigError(f"cannot resume: {workdir} holds results of an older specjax (record "
                      f"schema {saved.get('schema', 1)}, now {schema.SCHEMA_VERSION}); {fix}")
  old, new = saved.get("config") or {}, wd.normalised(cfg.to_dict())
  default = wd.normalised(_defaults())
  diff = sorted(k for k in new if k not in POINT_FIELDS
                and old.get(k, default.get(k)) != new[k])
  if diff:
    raise ConfigError(f"cannot resume: the workdir's sweep used different settings for "
                      f"{', '.join(diff)}; {fix}")
  was, now = machine(saved.get("env") or {}), machine(env)
  moved = [k for k in now if was.get(k) != now[k]]
  if moved:
    k = moved[0]
    raise ConfigError(f"cannot resume: the workdir's records were measured on another machine "
                      f"({k}: {was.get(k)} -> {now[k]}); {fix}")


def _defaults() -> Record:
  return {f.name: f.default for f in dataclasses.fields(SweepConfig)
          if f.default is not dataclasses.MISSING}


def claim(c: Claim, cfg: SweepConfig, env: Record) -> None:
  """After every check: old outputs aside (overwrite), results.jsonl with
  the finished records only, config.json."""
  os.makedirs(c.workdir, exist_ok=True)
  if c.overwrite:
    move_aside(c.workdir, c.outputs)
  wd.restart_jsonl(os.path.join(c.workdir, wd.RESULTS), c.done)  # a torn line is dropped
  wd.write_config(c.workdir, cfg.to_dict(), env, schema=schema.SCHEMA_VERSION)


def move_aside(workdir: str, names: tuple[str, ...]) -> str | None:
  """Moves the outputs a run would replace into WORKDIR/replaced-STAMP/;
  returns that folder (None when there was nothing to move)."""
  found = [p for p in [os.path.join(workdir, n) for n in names]
           + sorted(glob.glob(os.path.join(workdir, "*.png"))) if os.path.exists(p)]
  if not found:
    return None
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  dest = os.path.join(workdir, f"replaced-{stamp}")
  n = 1
  while os.path.exists(dest):
    n += 1
    dest = os.path.join(workdir, f"replaced-{stamp}-{n}")
  os.makedirs(dest)
  for p in found:
    shutil.move(p, os.path.join(dest, os.path.basename(p)))
  print(f"moved {len(found)} earlier output(s) aside into {dest}", flush=True)
  return dest
