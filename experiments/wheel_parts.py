"""A file too large for one device transfer, carried in parts over
consecutive device calls and put back together there, each part and the
whole checked by sha256 (BUILD.md, "A wheel larger than one transfer").

One call carries at most 64 MiB, the checkout included, so the parts are
sized to what the checkout leaves free (`--parts` forces a count). Every
part travels with the manifest; the calls before the last copy their part
out of the checkout (the next call's tree replaces it), the last joins.

  here:         python experiments/wheel_parts.py split FILE .parts
  call k < N:   python experiments/wheel_parts.py stash .parts/partK /tmp/specjax_parts
  call N:       python experiments/wheel_parts.py join /tmp/specjax_parts .parts/partN --out DIR

A missing part, a bad hash or an output that would overwrite another file
is one line and exit 1. Standard library only: it runs before anything is
installed there.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from specjax.errors import SpecjaxError  # noqa: E402  (no dependencies)

TRANSFER_LIMIT = 64 << 20  # bytes one device call carries, the working tree included
MARGIN = 1 << 20           # left free for files that change between the split and the calls
MANIFEST = "{name}.parts.json"


def sha256(path: str, offset: int = 0, size: int | None = None) -> str:
  """sha256 of `size` bytes of a file from `offset` (all to its end if None)."""
  h, left = hashlib.sha256(), size
  with open(path, "rb") as f:
    f.seek(offset)
    while left is None or left > 0:
      block = f.read(1 << 20 if left is None else min(1 << 20, left))
      if not block:
        break
      h.update(block)
      left = None if left is None else left - len(block)
  return h.hexdigest()


def checkout_bytes(root: str) -> int:
  """Bytes of what a device call sends from `root`: tracked files and
  untracked ones git does not ignore."""
  try:
    names = subprocess.run(["git", "-C", root, "ls-files", "-z", "-c", "-o", "--exclude-standard"],
                           check=True, capture_output=True).stdout.split(b"\0")
  except (OSError, subprocess.CalledProcessError) as e:
    raise SpecjaxError(f"cannot list the checkout at {root} with git ({e}); pass --parts") from e
  paths = (os.path.join(root, os.fsdecode(n)) for n in names if n)
  return sum(os.path.getsize(p) for p in paths if os.path.isfile(p))


def check_not_sent(out_dir: str, root: str) -> None:
  """Refuses an out_dir inside the checkout that git does not ignore: every
  device call would send all the parts (add it to .git/info/exclude)."""
  out, root = os.path.realpath(out_dir), os.path.realpath(root)
  if os.path.commonpath([out, root]) != root:
    return
  probe = os.path.join(os.path.relpath(out, root), "part1")
  ignored = subprocess.run(["git", "-C", root, "check-ignore", "-q", "--no-index", probe],
                           capture_output=True, check=False).returncode == 0
  if not ignored:
    raise SpecjaxError(f"{out_dir} is inside the checkout and not ignored: every device call "
                       f"would send all the parts; add /{os.path.relpath(out, root)}/ to "
                       ".git/info/exclude first")


def parts_needed(size: int, room: int) -> int:
  """How many parts of at most `room` bytes hold `size` bytes."""
  if room <= 0:
    raise SpecjaxError(f"the checkout leaves no room in a {TRANSFER_LIMIT >> 20} MiB transfer")
  return max(1, -(-size // room))


def split(path: str, out_dir: str, n_parts: int) -> dict:
  """Writes out_dir/part1 .. partN, each holding NAME.partK and the manifest
  (name, size, sha256, and each part's offset, size, sha256); returns the
  manifest. Refuses an out_dir that holds anything (nothing is overwritten)."""
  if not os.path.isfile(path):
    raise SpecjaxError(f"{path}: no such file")
  if n_parts < 1:
    raise SpecjaxError(f"--parts must be >= 1, got {n_parts}")
  if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
    raise SpecjaxError(f"{out_dir} exists and is not an empty folder; choose another")
  name, size = os.path.basename(path), os.path.getsize(path)
  step = -(-size // n_parts)
  parts = [{"file": f"{name}.part{k + 1}", "offset": k * step,
            "size": min(step, size - k * step)} for k in range(n_parts)]
  manifest = {"name": name, "size": size, "sha256": sha256(path), "parts": parts}
  with open(path, "rb") as src:
    for k, part in enumerate(parts):
      folder = os.path.join(out_dir, f"part{k + 1}")
      os.makedirs(folder)
      src.seek(part["offset"])
      with open(os.path.join(folder, part["file"]), "wb") as dst:
        dst.write(src.read(part["size"]))
      part["sha256"] = sha256(os.path.join(folder, part["file"]))
  for k in range(n_parts):
    with open(os.path.join(out_dir, f"part{k + 1}", MANIFEST.format(name=name)), "w") as f:
      json.dump(manifest, f, indent=1)
  return manifest


def read_manifest(folders: list[str]) -> dict:
  """The manifest the folders hold (one line if none, or if two differ)."""
  found = {}
  for folder in folders:
    for entry in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
      if entry.endswith(".parts.json"):
        with open(os.path.join(folder, entry)) as f:
          found[os.path.join(folder, entry)] = json.load(f)
  if not found:
    raise SpecjaxError(f"no *.parts.json manifest in {', '.join(folders)}")
  first = next(iter(found.values()))
  for where, m in found.items():
    if m != first:
      raise SpecjaxError(f"{where} is another file's manifest than {next(iter(found))}")
  return first


def find_part(manifest: dict, k: int, folders: list[str]) -> str:
  """Part k's path in the first folder that holds it, its size and hash checked."""
  part, n = manifest["parts"][k], len(manifest["parts"])
  for folder in folders:
    path = os.path.join(folder, part["file"])
    if os.path.isfile(path):
      if os.path.getsize(path) != part["size"] or sha256(path) != part["sha256"]:
        raise SpecjaxError(f"{path}: part {k + 1} of {n} is damaged (size or sha256 differs "
                           "from the manifest); carry it again")
      return path
  raise SpecjaxError(f"part {k + 1} of {n} ({part['file']}) is in none of: {', '.join(folders)}; "
                     "an earlier call's stash is lost if the machine went back between calls")


def stash(folder: str, dest: str) -> list[str]:
  """Copies the parts `folder` holds (checked) and the manifest into dest."""
  manifest = read_manifest([folder])
  held = [k for k, p in enumerate(manifest["parts"])
          if os.path.isfile(os.path.join(folder, p["file"]))]
  if not held:
    raise SpecjaxError(f"{folder} holds no part of {manifest['name']}")
  os.makedirs(dest, exist_ok=True)
  copied = [shutil.copy(find_part(manifest, k, [folder]), dest) for k in held]
  shutil.copy(os.path.join(folder, MANIFEST.format(name=manifest["name"])), dest)
  return copied


def join(folders: list[str], out_dir: str) -> str:
  """out_dir/NAME from its parts, found in `folders`; every part and the
  whole checked. An existing out_dir/NAME with the same hash is kept; one
  with another is refused."""
  manifest = read_manifest(folders)
  out = os.path.join(out_dir, manifest["name"])
  if os.path.exists(out):
    if os.path.isfile(out) and sha256(out) == manifest["sha256"]:
      return out
    raise SpecjaxError(f"{out} exists and is not {manifest['name']} as the manifest says; "
                       "move it or choose another --out")
  paths = [find_part(manifest, k, folders) for k in range(len(manifest["parts"]))]
  os.makedirs(out_dir, exist_ok=True)
  tmp = out + ".joining"
  with open(tmp, "wb") as dst:
    for p in paths:
      with open(p, "rb") as src:
        shutil.copyfileobj(src, dst, 1 << 20)
  if sha256(tmp) != manifest["sha256"]:
    os.remove(tmp)
    raise SpecjaxError(f"{manifest['name']}: the joined parts' sha256 differs from the manifest")
  os.replace(tmp, out)
  return out


def main(argv: list[str]) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
  sub = p.add_subparsers(dest="cmd", required=True)
  s = sub.add_parser("split", help="FILE into OUT/part1..N")
  s.add_argument("file")
  s.add_argument("out")
  s.add_argument("--parts", type=int, default=0, help="count (default: to fit each call)")
  s.add_argument("--checkout", default=".", help="the repository a device call sends")
  t = sub.add_parser("stash", help="a call's part, checked, out of the checkout")
  t.add_argument("folder")
  t.add_argument("dest")
  j = sub.add_parser("join", help="the parts from FOLDERS into --out")
  j.add_argument("folders", nargs="+")
  j.add_argument("--out", required=True)
  a = p.parse_args(argv)
  if a.cmd == "split":
    check_not_sent(a.out, a.checkout)
    size = os.path.getsize(a.file) if os.path.isfile(a.file) else 0
    room = TRANSFER_LIMIT - MARGIN - checkout_bytes(a.checkout) if not a.parts else 0
    n = a.parts or parts_needed(size, room)
    m = split(a.file, a.out, n)
    print(f"{m['name']}: {m['size'] / 2**20:.1f} MiB in {n} part(s) of at most "
          f"{max(x['size'] for x in m['parts']) / 2**20:.1f} MiB under {a.out}/part1..{n}"
          + (f" ({room / 2**20:.1f} MiB free beside the checkout per call)" if room else ""))
  elif a.cmd == "stash":
    print(f"stashed {', '.join(os.path.basename(x) for x in stash(a.folder, a.dest))} "
          f"in {a.dest}")
  else:
    print(f"joined {join(a.folders, a.out)} (sha256 checked)")


if __name__ == "__main__":
  try:
    main(sys.argv[1:])
  except (SpecjaxError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)
