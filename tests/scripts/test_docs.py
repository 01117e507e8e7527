"""Every command in README.md and docs/ still names a script, flags and configs
that exist, checked without running anything.

A command is `python experiments/NAME.py ...` (or `experiments/NAME.py ...`
alone, as in a table cell, or after the launcher's `--`) or
`python -m specjax.X ...`, in a ``` block or an inline code span. For each:
  * the script (or module) exists;
  * every --flag / --noflag is one the script defines: absl's DEFINE_* names
    read from its source (statically, no import: fast), from specjax modules
    it imports (module-level definitions, and those inside a function or
    class the script names, as cli.GenerationFlags), argparse's add_argument
    names, and absl's own (--helpfull, --flagfile, ...); --noX only for a
    boolean X;
  * --config=configs/F.py[:NAME]: the file exists and get_config(NAME) accepts
    NAME;
  * --config.a.b=V: the config (the command's, or the script's default) has
    the field a.b.
The static flag reader is checked against absl's own --helpfull on two
scripts, and a misspelt flag in a doc snippet must fail the checker.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import glob
import importlib.util
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = re.compile(r"(?:^|/)experiments/(\w+)\.py$")
SEPARATORS = {"&&", "||", ";", "|", "&", "(", ")", "--", ">", ">>", "<"}
BOOL_DEFINES = {"DEFINE_bool", "DEFINE_boolean"}


def doc_files() -> list[str]:
  return [os.path.join(ROOT, "README.md")] + sorted(
      glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))


# ------------------------------------------------------------ the commands


@dataclasses.dataclass
class Command:
  where: str            # "README.md:12"
  kind: str             # "script" | "module"
  target: str           # experiments/NAME.py or specjax.X
  args: list[str]
  text: str             # the snippet, for the message

  def __str__(self):
    return f"{self.where}: {self.text.strip()}"


def snippets(text: str) -> list[tuple[int, str]]:
  """(line, code) of every fenced block line (continuations joined) and every
  inline code span (newlines inside a span are spaces)."""
  out = []
  rest = []
  pos = 0
  for m in re.finditer(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```[ \t]*$", text, re.S | re.M):
    rest.append((pos, text[pos:m.start()]))
    pos = m.end()
    first = text.count("\n", 0, m.start(1)) + 1
    lines = m.group(1).split("\n")
    i = 0
    while i < len(lines):
      start, line = i, lines[i]
      while line.rstrip().endswith("\\") and i + 1 < len(lines):
        i += 1
        line = line.rstrip()[:-1] + " " + lines[i]
      out.append((first + start, line))
      i += 1
  rest.append((pos, text[pos:]))
  for offset, chunk in rest:
    for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", chunk):
      line = text.count("\n", 0, offset + m.start()) + 1
      out.append((line, m.group(1).replace("\\\n", " ").replace("\n", " ")))
  return out


def parse_commands(text: str, name: str) -> list[Command]:
  """The script and module commands of a document's text."""
  commands = []
  for line, code in snippets(text):
    if "experiments/" not in code and "-m specjax" not in code:
      continue
    where = f"{name}:{line}"
    try:
      lex = shlex.shlex(code, posix=True, punctuation_chars=True)
      lex.whitespace_split = True
      tokens = list(lex)
    except ValueError as e:
      commands.append(Command(where, "unparsable", str(e), [], code))
      continue
    i = 0
    while i < len(tokens):
      tok = tokens[i]
      start = None
      if SCRIPT.search(tok):
        start, kind, target = i + 1, "script", tok[tok.index("experiments/"):]
      elif (tok in ("python", "python3") and tokens[i + 1:i + 2] == ["-m"]
            and tokens[i + 2:i + 3] and tokens[i + 2].startswith("specjax")):
        start, kind, target = i + 3, "module", tokens[i + 2]
      if start is None:
        i += 1
        continue
      j = start
      while j < len(tokens) and tokens[j] not in SEPARATORS:
        j += 1
      commands.append(Command(where, kind, target, tokens[start:j], code))
      i = j
  return commands


# ------------------------------------------------------------ what a script defines


@dataclasses.dataclass
class Defined:
  flags: set[str]
  bools: set[str]
  configs: dict[str, str]  # config flag name -> default config file (relative to ROOT)
  config_names: dict[str, str | None] = dataclasses.field(default_factory=dict)  # its ":NAME"


def _named_closure(tree: ast.AST, referenced: set[str]) -> set[str]:
  """`referenced` plus the module's top-level functions and classes that the
  named ones use in turn (cli.GenerationFlags builds a cli.PromptFlags)."""
  defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
  names, todo = set(referenced), [n for n in referenced if n in defs]
  while todo:
    for node in ast.walk(defs[todo.pop()]):
      name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)
      if name in defs and name not in names:
        names.add(name)
        todo.append(name)
  return names


def _defines(tree: ast.AST, referenced: set[str] | None) -> Defined:
  """DEFINE_* / add_argument names in a module's tree. With `referenced`,
  definitions inside a function or class count only when it is named there
  (or used by one that is)."""
  out = Defined(set(), set(), {})
  if referenced is not None:
    referenced = _named_closure(tree, referenced)

  def visit(node, scope_ok):
    for child in ast.iter_child_nodes(node):
      ok = scope_ok
      if (referenced is not None and node is tree
          and isinstance(child, (ast.FunctionDef, ast.ClassDef))):
        ok = child.name in referenced  # a top-level function or class: if the script names it
      if isinstance(child, ast.Call) and ok:
        func = child.func
        fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        args = [a.value for a in child.args if isinstance(a, ast.Constant)]
        kw = {k.arg: k.value.value for k in child.keywords if isinstance(k.value, ast.Constant)}
        first = child.args[0] if child.args else None
        name = first.value if isinstance(first, ast.Constant) else kw.get("name")
        if fname.startswith("DEFINE") and isinstance(name, str):
          out.flags.add(name)
          if fname in BOOL_DEFINES:
            out.bools.add(name)
          if fname == "DEFINE_config_file":
            paths = [n.value for n in ast.walk(child) if isinstance(n, ast.Constant)
                     and isinstance(n.value, str) and n.value.endswith(".py")]
            out.configs[name] = os.path.join("configs", os.path.basename(paths[0])) if paths else ""
            suffix = [n.value[1:] for n in ast.walk(child) if isinstance(n, ast.Constant)
                      and isinstance(n.value, str) and re.fullmatch(r":\w+", n.value)]
            out.config_names[name] = suffix[0] if suffix else None  # "...py" + ":smollm2"
        elif fname == "add_argument":
          for a in args:
            if isinstance(a, str) and a.startswith("--"):
              out.flags.add(a[2:])
      visit(child, ok)

  visit(tree, True)
  return out


def _module_file(module: str) -> str | None:
  path = os.path.join(ROOT, *module.split("."))
  for candidate in (path + ".py", os.path.join(path, "__init__.py")):
    if os.path.exists(candidate):
      return candidate
  return None


def _imported_specjax(tree: ast.AST) -> set[str]:
  mods = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      mods |= {a.name for a in node.names if a.name.startswith("specjax")}
    elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("specjax"):
      mods.add(node.module)
      mods |= {f"{node.module}.{a.name}" for a in node.names}
  return {m for m in mods if _module_file(m)}


HELP_FLAG = re.compile(r"^\s+--(\[no\])?([\w.-]+):", re.M)


def helpfull(argv: list[str]) -> tuple[set[str], set[str]]:
  """(flags, booleans) that absl's --helpfull lists for a command."""
  proc = subprocess.run([sys.executable, *argv, "--helpfull"], capture_output=True, text=True,
                        cwd=ROOT, timeout=120)
  found = HELP_FLAG.findall(proc.stdout)
  assert found, proc.stdout + proc.stderr
  return {n for _, n in found}, {n for no, n in found if no}


@functools.lru_cache(maxsize=None)
def absl_own_flags() -> tuple[frozenset[str], frozenset[str]]:
  """Flags absl itself gives every app (--helpfull, --flagfile, logging's)."""
  names, bools = helpfull(["-c", "from absl import app; app.run(lambda argv: None)"])
  return frozenset(names), frozenset(bools)


@functools.lru_cache(maxsize=None)
def defined(path: str) -> Defined:
  """Every flag the script or module at `path` accepts, read from source."""
  tree = ast.parse(open(path).read())
  names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
  names |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
  out = _defines(tree, None)
  seen, todo = set(), list(_imported_specjax(tree))
  while todo:
    mod = todo.pop()
    if mod in seen:
      continue
    seen.add(mod)
    source = open(_module_file(mod)).read()
    if "DEFINE" not in source and "add_argument(" not in source:
      continue  # defines no flags: not parsed (nor its imports followed)
    sub = ast.parse(source)
    got = _defines(sub, names)
    out.flags |= got.flags
    out.bools |= got.bools
    todo += _imported_specjax(sub)
  if "specjax.cli" in seen or "absl" in open(path).read():  # an absl app
    names, bools = absl_own_flags()
    out.flags |= names
    out.bools |= bools
  return out


# ------------------------------------------------------------ configs


@functools.lru_cache(maxsize=None)
def load_config(path: str, name: str | None):
  """get_config(name) of configs/F.py (no name: its default); raises on a bad name."""
  spec = importlib.util.spec_from_file_location(f"_doc_config_{abs(hash(path))}",
                                                os.path.join(ROOT, path))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(name) if name is not None else module.get_config()


def _has_field(cfg, dotted: str) -> bool:
  node = cfg
  for part in dotted.split("."):
    try:
      node = node[part]
    except (KeyError, TypeError, AttributeError):
      return False
  return True


# ------------------------------------------------------------ the checker


def check(cmd: Command) -> list[str]:
  """What is wrong with one command (empty: nothing)."""
  if cmd.kind == "unparsable":
    return [f"{cmd}: cannot split it as a shell line ({cmd.target})"]
  if cmd.kind == "script":
    path = os.path.join(ROOT, cmd.target)
  else:
    path = _module_file(cmd.target)
  if path is None or not os.path.exists(path):
    return [f"{cmd}: no such {cmd.kind} {cmd.target}"]
  d = defined(path)
  problems = []
  config_file = dict(d.configs)  # flag -> file
  config_name = dict(d.config_names)  # flag -> the script's default ":NAME" (None: default)
  for arg in cmd.args:
    m = re.match(r"--([\w-]+)=(configs/\w+\.py)(?::(\w+))?$", arg)
    if m and m.group(1) in d.configs:
      config_file[m.group(1)], config_name[m.group(1)] = m.group(2), m.group(3)
  for arg in cmd.args:
    if not arg.startswith("--") or arg == "--":
      continue
    name = arg[2:].split("=", 1)[0]
    base = name.split(".", 1)[0]
    if "." in name and base in d.configs:
      cfg_path = config_file[base]
      try:
        cfg = load_config(cfg_path, config_name.get(base))
      except Exception:  # reported below, with the --config value
        continue
      field = name.split(".", 1)[1]
      if not _has_field(cfg, field):
        problems.append(f"{cmd}: {cfg_path}:{config_name.get(base) or 'default'} has no field "
                        f"{field!r} ({arg})")
      continue
    if base in d.configs and "=" in arg:
      value = arg.split("=", 1)[1]
      m = re.match(r"(configs/\w+\.py)(?::(\w+))?$", value)
      if not m:
        problems.append(f"{cmd}: --{base} is not configs/F.py[:NAME] ({arg})")
      elif not os.path.exists(os.path.join(ROOT, m.group(1))):
        problems.append(f"{cmd}: no config file {m.group(1)}")
      else:
        try:
          load_config(m.group(1), m.group(2))
        except Exception as e:
          problems.append(f"{cmd}: {m.group(1)} has no config {m.group(2)!r} ({e})")
      continue
    if name in d.flags:
      continue
    if name.startswith("no") and name[2:] in d.bools and "=" not in arg:
      continue
    problems.append(f"{cmd}: {cmd.target} has no flag --{name}")
  return problems


def check_text(text: str, name: str) -> tuple[list[Command], list[str]]:
  commands = parse_commands(text, name)
  return commands, [p for c in commands for p in check(c)]


# ------------------------------------------------------------ links and paths


def slug(heading: str) -> str:
  """GitHub's anchor for a heading."""
  text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
  return text.replace(" ", "-")


def check_references(text: str, path: str) -> list[str]:
  """What is broken among a document's relative links (files and #anchors),
  the specjax/ and tests/ paths it names, and its specjax.x.y names."""
  problems = []
  here = os.path.dirname(path)
  name = os.path.relpath(path, ROOT)
  code_free = re.sub(r"```.*?```", "", text, flags=re.S)
  for m in re.finditer(r"\]\(([^)\s]+)\)", code_free):
    target = m.group(1)
    if re.match(r"[a-z]+:", target):
      continue  # http(s), mailto
    file, _, anchor = target.partition("#")
    full = os.path.normpath(os.path.join(here, file)) if file else path
    if not os.path.exists(full):
      problems.append(f"{name}: link to a missing file: {target}")
    elif anchor and full.endswith(".md"):
      body = re.sub(r"```.*?```", "", open(full).read(), flags=re.S)
      anchors = {slug(h) for h in re.findall(r"^#+\s+(.*)$", body, re.M)}
      if anchor not in anchors:
        problems.append(f"{name}: link to a missing heading: {target}")
  for m in re.finditer(r"(?<![\w/.])((?:specjax|tests|experiments|configs)/[\w/.-]*)", text):
    ref = m.group(1).rstrip(".")
    if "NAME" not in ref and not os.path.exists(os.path.join(ROOT, ref)):
      problems.append(f"{name}: no such path {ref}")
  for m in re.finditer(r"(?<![\w/.])specjax(?:\.\w+)+", text):
    parts = m.group(0).split(".")
    k = len(parts)
    while k > 1 and _module_file(".".join(parts[:k])) is None:
      k -= 1
    rest = parts[k:]
    if k == 1 or len(rest) > 1:
      problems.append(f"{name}: no such module {m.group(0)}")
    elif rest:
      tree = ast.parse(open(_module_file(".".join(parts[:k]))).read())
      names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
      names |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Name)}
      if rest[0] not in names:
        problems.append(f"{name}: {'.'.join(parts[:k])} defines no {rest[0]}")
  return problems


# ------------------------------------------------------------ tests


def test_docs_commands_name_real_scripts_flags_and_configs():
  problems, n = [], 0
  for path in doc_files():
    commands, found = check_text(open(path).read(), os.path.relpath(path, ROOT))
    n += len(commands)
    problems += found
  assert n >= 30, n  # the extraction itself still finds the docs' commands
  assert not problems, "\n".join(problems)


@pytest.mark.parametrize("snippet,pattern", [
    ("```bash\npython experiments/speculative.py --n_predcit=8\n```", r"no flag --n_predcit"),
    ("Run `python experiments/sweep_gamma.py --workdir=/tmp/w --noresum`.", r"no flag --noresum"),
    ("```bash\npython experiments/generate.py --nomodel\n```", r"no flag --nomodel"),
    ("```bash\npython experiments/sweep_gamma.py --config=configs/sweep_gamma.py:quikc\n```",
     r"no config 'quikc'"),
    ("```bash\npython experiments/sweep_gamma.py --config=configs/sweep_gamma.py:quick \\\n"
     "    --config.gamas=1,2\n```", r"no field 'gamas'"),
    ("```bash\npython experiments/train_eagle.py --config=configs/train.py:eagle "
     "--config.eagle_train.stepz=9\n```", r"no field 'eagle_train.stepz'"),
    # the script's own default config (train.py + ":smollm2") is the one checked
    ("`python experiments/train_smollm2.py --config.mix.edti=0`",
     r"configs/train.py:smollm2 has no field 'mix.edti'"),
    ("```bash\npython experiments/no_such_script.py --model=tiny\n```", r"no such script"),
    ("```bash\npython -m specjax.parallel.launch --num_process=2 -- experiments/generate.py\n```",
     r"no flag --num_process"),
    ("```bash\npython -m specjax.parallel.launch --num_processes=2 -- "
     "experiments/generate.py --modle=tiny\n```", r"generate.py has no flag --modle"),
])
def test_a_misspelt_command_fails_the_checker(snippet, pattern):
  commands, problems = check_text(snippet, "snippet.md")
  assert commands, snippet
  assert len(problems) == 1 and re.search(pattern, problems[0]), problems


def test_the_same_commands_spelt_right_pass():
  snippet = ("```bash\npython experiments/speculative.py --n_predict=8 --nobaseline --mesh=model:2 "
             "--temp=0.8 --drafter=ngram --helpfull\n"
             "python experiments/sweep_gamma.py --config=configs/sweep_gamma.py:quick \\\n"
             "    --config.gammas=1,2 --resume\n"
             "python -m specjax.parallel.launch --num_processes=2 -- "
             "experiments/generate.py --model=tiny\n```\n"
             "and `python experiments/train_eagle.py --config=configs/train.py:eagle "
             "--config.eagle_train.steps=9`, `python experiments/train_smollm2.py "
             "--config.mix.edit=0 --config.head_train.feature_noise=0.1`.")
  commands, problems = check_text(snippet, "snippet.md")
  assert [c.target for c in commands] == [
      "experiments/speculative.py", "experiments/sweep_gamma.py", "specjax.parallel.launch",
      "experiments/generate.py", "experiments/train_eagle.py", "experiments/train_smollm2.py"]
  assert not problems, problems


@pytest.mark.parametrize("script", ["speculative.py", "sweep_gamma.py"])
def test_static_flags_match_absls_own(script):
  """The source reader sees what absl registers (run once: about 2 s each)."""
  path = os.path.join(ROOT, "experiments", script)
  listed, bools = helpfull([path])
  assert len(listed) > 20, listed
  d = defined(path)
  assert d.flags == listed
  assert d.bools == bools


def test_docs_links_paths_and_names_exist():
  problems = []
  for path in doc_files():
    problems += check_references(open(path).read(), path)
  assert not problems, "\n".join(problems)


@pytest.mark.parametrize("snippet,pattern", [
    ("see [the sweep](sweep.md#the-sweeep)", r"missing heading: sweep.md#the-sweeep"),
    ("![plot](no_such_plot.png)", r"missing file: no_such_plot.png"),
    ("the loop is `specjax/speculative.py`.", r"no such path specjax/speculative.py"),
    ("saved by `specjax.formats.checkpoint.saev`", r"checkpoint defines no saev"),
    ("run `python -m specjax.launch`", r"no such module specjax.launch"),
])
def test_a_broken_reference_fails_the_checker(snippet, pattern):
  problems = check_references(snippet, os.path.join(ROOT, "docs", "snippet.md"))
  assert len(problems) == 1 and re.search(pattern, problems[0]), problems
