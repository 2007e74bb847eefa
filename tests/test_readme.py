"""The Python examples of the README and of the guides run as written.

The README's example must also show, in what it prints, what jaxamp is for: a
scale that moves and a step skipped on an overflow, and the printed output shown
under it must be what it prints.
"""

import pathlib
import re

import pytest
from test_docs import shown_outputs

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", ROOT / "docs" / "protections.md"]
# torch.amp.GradScaler's defaults, from torch's documentation.
TORCH_INIT_SCALE, TORCH_BACKOFF, TORCH_GROWTH = 65536.0, 0.5, 2.0
STEP_LINE = re.compile(r"step (\d+): skipped=(True|False) scale=(\S+)")


def _blocks(text: str, language: str) -> list[str]:
  return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: p.name)
def test_readme_and_guides_python_examples_run(path, capsys):
  blocks, outputs = _blocks(path.read_text(), "python"), shown_outputs(path)
  assert blocks, f"{path.name} has no python example"
  assert len(outputs) == len(blocks)
  for number, (block, shown) in enumerate(zip(blocks, outputs), 1):
    capsys.readouterr()
    # Running the documented code as written is the test.
    exec(compile(block, str(path), "exec"), {})  # noqa: S102
    assert shown is not None, f"{path.name}, python block {number}, does not say what it prints"
    printed = capsys.readouterr().out
    assert printed == shown, (
      f"{path.name}, python block {number}, shows another output than it prints"
    )


def test_readme_example_prints_a_moving_scale_and_a_skipped_step(capsys):
  text = (ROOT / "README.md").read_text()
  first_code = text.index("```")
  assert len(text[:first_code].splitlines()) <= 15, "what and why fit above the first code block"
  [example] = _blocks(text, "python")
  exec(compile(example, "README.md", "exec"), {})  # noqa: S102
  printed = capsys.readouterr().out
  steps = STEP_LINE.findall(printed)
  assert len(steps) >= 4, printed
  skipped = [flag == "True" for _, flag, _ in steps]
  scales = [float(scale) for _, _, scale in steps]
  assert any(skipped) and not all(skipped), printed
  assert len(set(scales)) > 1, f"the scale never moved:\n{printed}"
  # Each printed scale follows from the one before by torch's rule: halved on a
  # skipped step, otherwise kept or doubled (growth_interval clean steps).
  previous = TORCH_INIT_SCALE
  for was_skipped, scale in zip(skipped, scales):
    allowed = {previous * TORCH_BACKOFF} if was_skipped else {previous, previous * TORCH_GROWTH}
    assert scale in allowed, printed
    previous = scale
  # The output shown in the README is the output of the example.
  shown = [block for block in _blocks(text, "text") if STEP_LINE.search(block)]
  assert shown == [printed], f"the README shows another output than it prints:\n{printed}"


def test_quickstart_opens_with_the_readme_example_and_its_output():
  readme, quickstart = (
    (ROOT / "README.md").read_text(),
    (ROOT / "docs" / "quickstart.md").read_text(),
  )
  assert _blocks(quickstart, "python")[0] == _blocks(readme, "python")[0]
  shown = [block for block in _blocks(quickstart, "text") if STEP_LINE.search(block)]
  assert shown == [block for block in _blocks(readme, "text") if STEP_LINE.search(block)]
