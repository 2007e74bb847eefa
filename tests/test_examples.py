"""The examples run end to end, briefly (CI-sized)."""

import importlib
import pathlib

import numpy as np
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def import_example(monkeypatch):
  monkeypatch.syspath_prepend(str(EXAMPLES))
  return importlib.import_module


@pytest.mark.slow
@pytest.mark.parametrize(
  "name, flags",
  [("nnx_digits", []), ("nnx_digits", ["--autocast"]), ("linen_digits", [])],
  ids=["nnx_digits", "nnx_digits_autocast", "linen_digits"],
)
def test_examples_digits_trains_and_writes_png(name, flags, import_example, tmp_path, capsys):
  png = tmp_path / "curves.png"
  result = import_example(name).main(["--steps", "20", "--out", str(png), *flags])
  assert png.read_bytes()[:8] == PNG_MAGIC
  losses = result["losses"]
  assert losses.shape == (20,) and np.all(np.isfinite(losses))
  assert losses[-5:].mean() < losses[:5].mean()
  assert result["test_accuracy"] > 0.4  # ten classes: chance is 0.1
  assert result["skipped_steps"] == 0
  assert "test accuracy" in capsys.readouterr().out


@pytest.mark.slow
def test_examples_eqx_digits_trains_in_float16_with_a_frozen_layer(import_example, tmp_path):
  pytest.importorskip("equinox")
  png = tmp_path / "curves.png"
  result = import_example("eqx_digits").main(["--steps", "20", "--out", str(png)])
  assert png.read_bytes()[:8] == PNG_MAGIC
  losses = result["losses"]
  assert losses.shape == (20,) and np.all(np.isfinite(losses))
  assert losses[-5:].mean() < losses[:5].mean()
  assert result["test_accuracy"] > 0.4  # ten classes: chance is 0.1
  assert result["skipped_steps"] == 0
  assert result["frozen_unchanged"]


@pytest.mark.slow
def test_examples_underflow_study_writes_markdown_table(import_example, tmp_path):
  out = tmp_path / "underflow.md"
  args = ["--steps", "12", "--depths", "2", "--measure-every", "4", "--out", str(out)]
  results = import_example("underflow_study").main(args)
  text = out.read_text()
  rows = [line for line in text.splitlines() if line.startswith("| 2 |")]
  assert [row.split(" | ")[1] for row in rows] == [
    "float32",
    "float16",
    "float16 + jaxamp",
    "float16 + jaxamp, growth_interval=200",
  ]
  assert "python examples/underflow_study.py --steps 12 --depths 2" in text
  for name, r in results[2].items():
    assert 0.0 <= r["accuracy"] <= 1.0
    if name != "float32":
      assert 0.0 <= r["underflow"] <= 1.0


def _python_blocks(markdown):
  blocks, inside = [], None
  for line in markdown.splitlines():
    if inside is None and line.strip() == "```python":
      inside = []
    elif inside is not None and line.strip() == "```":
      blocks.append("\n".join(inside))
      inside = None
    elif inside is not None:
      inside.append(line)
  return blocks


def test_docs_flax_code_blocks_run(capsys):
  docs = (EXAMPLES.parent / "docs" / "flax.md").read_text()
  blocks = _python_blocks(docs)
  assert len(blocks) == 3
  for block in blocks:
    # Running the documented code as written is the test.
    exec(compile(block, "docs/flax.md", "exec"), {})  # noqa: S102
  printed = capsys.readouterr().out.split("\n")
  # each loop prints "<loss> 65536.0 0": three steps at the default scale, none skipped
  assert [line.split()[1:] for line in printed if line] == [["65536.0", "0"]] * 2
