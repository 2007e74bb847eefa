"""The package's layers import downward only: ``jaxamp/_torch/`` (torch's
arithmetic in plain JAX) imports nothing from the engine, the front-ends or the
compiler workarounds above it."""

import ast
import pathlib

import jaxamp

PACKAGE = pathlib.Path(jaxamp.__file__).parent
# What _torch/ may build on: itself, the option record, input checks, and the
# skip limit's check (a primitive of its own, no front-end).
BELOW_TORCH = (
  "jaxamp._torch",
  "jaxamp._config",
  "jaxamp._hyperparams",
  "jaxamp._validation",
  "jaxamp._skip_limit",
)


def _jaxamp_imports(path: pathlib.Path) -> list[str]:
  names = []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jaxamp"):
      names += (
        [node.module] if node.module != "jaxamp" else [f"jaxamp.{a.name}" for a in node.names]
      )
    elif isinstance(node, ast.Import):
      names += [a.name for a in node.names if a.name.startswith("jaxamp")]
  return names


def test_layering_torch_imports_nothing_above_it():
  upward = {
    f"{path.name}: {name}"
    for path in sorted((PACKAGE / "_torch").glob("*.py"))
    for name in _jaxamp_imports(path)
    if not name.startswith(BELOW_TORCH)
  }
  assert upward == set()


def test_layering_check_finds_an_upward_import(tmp_path):
  # The control: the parser sees both import forms the package uses.
  module = tmp_path / "m.py"
  module.write_text("from jaxamp import _engine as engine\nimport jaxamp._frontends.fused\n")
  assert _jaxamp_imports(module) == ["jaxamp._engine", "jaxamp._frontends.fused"]
