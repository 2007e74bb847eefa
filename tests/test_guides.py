"""The Python blocks of the porting guides run as written, in order, one namespace per guide."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The shorter guide first: the inner loop (-m "not slow") runs a parametrized test's
# first case only (tests/conftest.py); porting.md trains more and runs in the full suite.
GUIDES = [ROOT / "docs" / "migrating_from_dynamic_scale.md", ROOT / "docs" / "porting.md"]


def python_blocks(path):
  """The ```python blocks of ``path``, in order."""
  return re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.DOTALL | re.MULTILINE)


@pytest.mark.torch
@pytest.mark.parametrize("path", GUIDES, ids=lambda p: p.name)
def test_guide_python_blocks_run_in_order(path):
  pytest.importorskip("torch")
  pytest.importorskip("flax")
  blocks = python_blocks(path)
  assert len(blocks) >= 5, f"{path.name} has {len(blocks)} python blocks"
  namespace = {"__name__": f"guide_{path.stem}"}
  for number, block in enumerate(blocks, 1):
    # Running the documented code as written is the test; the blocks share one
    # namespace, as a reader pastes them into one session.
    code = compile(block, f"{path.name} (python block {number})", "exec")
    exec(code, namespace)  # noqa: S102
