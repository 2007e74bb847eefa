"""JAX's private modules are imported in one place only, and fail loudly when they move."""

import importlib
import pathlib
import re

import jax

import jaxamp

ROOT = pathlib.Path(jaxamp.__file__).parent
INTERNALS = ROOT / "_xla" / "jax_internals.py"


def test_jax_internals_are_imported_only_by_their_module():
  private = re.compile(r"^\s*(from|import)\s+jax\._src", re.MULTILINE)
  users = sorted(
    str(path.relative_to(ROOT)) for path in ROOT.rglob("*.py") if private.search(path.read_text())
  )
  assert users == ["_xla/jax_internals.py"], users


def test_jax_internals_still_exist_in_this_jax():
  # Each private name jaxamp uses, looked up afresh: a JAX release that moves
  # one fails here by name, not somewhere inside a training step.
  checkify = importlib.import_module("jax._src.checkify")
  for name in ("FailedCheckError", "get_traceback", "assert_func", "error_checks"):
    assert hasattr(checkify, name), f"jax._src.checkify.{name} moved (jax {jax.__version__})"
  assert hasattr(importlib.import_module("jax._src.debugging"), "debug_effect")
