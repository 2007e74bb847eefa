"""The Python blocks of the porting guides run as written, in order, one namespace per
guide, and each prints what the guide shows after it (tests/test_docs.py: a paragraph
ending in "prints:" and a ```text block, or "prints nothing.")."""

import pathlib

import pytest
from test_docs import python_blocks, shown_outputs

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The shorter guide first: the inner loop (-m "not slow") runs a parametrized test's
# first case only (tests/conftest.py); porting.md trains more and runs in the full suite.
GUIDES = [ROOT / "docs" / "migrating_from_dynamic_scale.md", ROOT / "docs" / "porting.md"]


@pytest.mark.torch
@pytest.mark.parametrize("path", GUIDES, ids=lambda p: p.name)
def test_guide_python_blocks_run_in_order(path, capsys):
  pytest.importorskip("torch")
  pytest.importorskip("flax")
  blocks, outputs = python_blocks(path), shown_outputs(path)
  assert len(blocks) >= 5, f"{path.name} has {len(blocks)} python blocks"
  assert len(outputs) == len(blocks)
  namespace = {"__name__": f"guide_{path.stem}"}
  for number, (block, shown) in enumerate(zip(blocks, outputs), 1):
    capsys.readouterr()
    # Running the documented code as written is the test; the blocks share one
    # namespace, as a reader pastes them into one session.
    code = compile(block, f"{path.name} (python block {number})", "exec")
    exec(code, namespace)  # noqa: S102
    if shown is not None:  # every block states it (tests/test_docs.py, STATE_EVERY_OUTPUT)
      printed = capsys.readouterr().out
      assert printed == shown, (
        f"{path.name}, python block {number}, shows another output than it prints"
      )
