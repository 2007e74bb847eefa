"""The Python examples of the README and of the guides run as written."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", ROOT / "docs" / "protections.md"]


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: p.name)
def test_readme_and_guides_python_examples_run(path):
  blocks = re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.DOTALL)
  assert blocks, f"{path.name} has no python example"
  for block in blocks:
    # Running the documented code as written is the test.
    exec(compile(block, str(path), "exec"), {})  # noqa: S102
