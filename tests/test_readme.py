"""The README's Python examples run as written."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_examples_run():
  blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
  assert blocks, "the README has no python example"
  for block in blocks:
    # Running the documented code as written is the test.
    exec(compile(block, str(README), "exec"), {})  # noqa: S102
