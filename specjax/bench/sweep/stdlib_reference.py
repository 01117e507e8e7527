"""Reference pages of Python stdlib modules, read from their source: the
long-context suite's documents (longsuite.py).

A page lists a module the way pydoc does: its docstring, then each public
class, function and method in source order, as its signature line and its
docstring. The source is parsed with `ast`, nothing imported or run, so a
page is the running interpreter's file and nothing else. A page is a list of
`Block`s, the units a document is cut at; its text is the blocks' texts
joined by blank lines.
"""

from __future__ import annotations

import ast
import dataclasses
import re

INDENT = "    "


@dataclasses.dataclass(frozen=True)
class Block:
  """One entry of a page: a module's docstring, or a class or function."""
  name: str       # qualified within its module: "Class.method"; the module's dotted name
  signature: str  # the header line as the page writes it
  doc: str        # the docstring, cleaned by ast.get_docstring ("" if none)

  @property
  def text(self) -> str:
    body = "\n".join(INDENT + line if line.strip() else "" for line in self.doc.splitlines())
    return self.signature + ("\n" + body if body else "")

  @property
  def first_sentence(self) -> str:
    """The docstring's first sentence on one line ("" if it has none)."""
    para = " ".join(self.doc.split("\n\n", 1)[0].split())
    m = re.match(r"(.+?[.!?])(\s|$)", para)
    return m.group(1) if m else ""


def module_name(rel_path: str) -> str:
  """idlelib/config.py -> idlelib.config; a package's __init__.py -> the package."""
  parts = rel_path[:-len(".py")].split("/")
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def public(name: str, node: ast.AST) -> bool:
  """Listed: a public name, or a dunder that has a docstring."""
  if name.startswith("__") and name.endswith("__"):
    return bool(ast.get_docstring(node))
  return not name.startswith("_")


def signature(node: ast.AST, qual: str) -> str:
  """`class Q(bases)` for a class, `Q(args) -> ret` for a function."""
  if isinstance(node, ast.ClassDef):
    bases = ", ".join(ast.unparse(b) for b in node.bases + node.keywords)
    return f"class {qual}" + (f"({bases})" if bases else "")
  ret = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
  prefix = "async " if isinstance(node, ast.AsyncFunctionDef) else ""
  return f"{prefix}{qual}({ast.unparse(node.args)}){ret}"


def _entries(body: list[ast.stmt], prefix: str) -> list[Block]:
  out = []
  for node in body:
    if not isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      continue
    if not public(node.name, node):
      continue
    qual = prefix + node.name
    out.append(Block(qual, signature(node, qual), ast.get_docstring(node) or ""))
    if isinstance(node, ast.ClassDef):
      out += _entries(node.body, qual + ".")
  return out


def page(rel_path: str, source: str) -> list[Block]:
  """The page of the module at `rel_path` (relative to the stdlib root)."""
  tree = ast.parse(source, rel_path)
  name = module_name(rel_path)
  return [Block(name, f"Module {name}", ast.get_docstring(tree) or "")] + _entries(tree.body, "")


def text(blocks: list[Block]) -> str:
  return "\n\n".join(b.text for b in blocks)
