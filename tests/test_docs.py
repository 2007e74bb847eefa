"""Every ```python block of the README and of docs/ runs as a test.

Most documents are run by the tests next to their subject (COVERED_ELSEWHERE);
this file runs the others, in order, one namespace per document (a reader pastes
them into one session), and checks that no document with a python block is left
out. A block that cannot run as written (torch and jaxamp side by side, a
fragment) is a ```text block. A python block followed by a paragraph ending in
"prints:" and a ```text block must print that text.
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

# document -> the test that runs its python blocks
COVERED_ELSEWHERE = {
  "README.md": "tests/test_readme.py",
  "docs/protections.md": "tests/test_readme.py",
  "docs/porting.md": "tests/test_guides.py",
  "docs/migrating_from_dynamic_scale.md": "tests/test_guides.py",
  "docs/flax.md": "tests/test_examples.py::test_docs_flax_code_blocks_run",
  "docs/distributed.md": "tests/test_distributed.py::test_distributed_doc_python_examples_run",
  "docs/equinox.md": "tests/test_equinox.py::test_docs_equinox_python_blocks_run",
  "docs/precision.md": "tests/test_flax_seams.py::test_docs_precision_python_blocks_run",
}
RUN_HERE = [
  "docs/quickstart.md",
  "docs/grad_scaler.md",
  "docs/speed.md",
  "docs/optax.md",
  "docs/autocast.md",
  "docs/index.md",
]


def python_blocks(path):
  """The ```python blocks of ``path``, in order."""
  return re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.DOTALL | re.MULTILINE)


def shown_outputs(path):
  """Per python block of ``path``: the ```text block that a paragraph ending in
  "prints:" shows right after it, "" after a paragraph ending in "prints nothing.",
  or None."""
  pattern = (
    r"^```python\n.*?^```\n(?:\n(?:(?!```)[^\n]*\n)*?"
    r"(?:[^\n]*prints:\n\n```text\n(.*?)^```|[^\n]*(prints nothing)\.\n))?"
  )
  return [
    match.group(1) if match.group(2) is None else ""
    for match in re.finditer(pattern, path.read_text(), flags=re.DOTALL | re.MULTILINE)
  ]


def test_docs_every_python_block_is_run_by_a_test():
  documents = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
  with_python = {str(p.relative_to(ROOT)) for p in documents if python_blocks(p)}
  run = set(COVERED_ELSEWHERE) | set(RUN_HERE)
  assert with_python <= run, f"python blocks no test runs: {sorted(with_python - run)}"
  for name, test in COVERED_ELSEWHERE.items():
    assert (ROOT / test.split("::")[0]).exists(), test
    assert pathlib.Path(name).name in (ROOT / test.split("::")[0]).read_text(), (name, test)


@pytest.mark.slow
@pytest.mark.parametrize("name", RUN_HERE)
def test_docs_python_blocks_run_in_order(name, capsys):
  pytest.importorskip("flax")
  path = ROOT / name
  blocks, outputs = python_blocks(path), shown_outputs(path)
  assert blocks, f"{name} has no python block"
  assert len(outputs) == len(blocks)
  namespace = {"__name__": f"docs_{path.stem}"}
  for number, (block, shown) in enumerate(zip(blocks, outputs), 1):
    capsys.readouterr()
    # Running the documented code as written is the test.
    exec(compile(block, f"{name} (python block {number})", "exec"), namespace)  # noqa: S102
    if shown is not None:
      printed = capsys.readouterr().out
      assert printed == shown, f"{name}, python block {number}, shows another output than it prints"


# The pages with python blocks (README.md, docs/**/*.md): each block states what it
# prints ("prints:" or "prints nothing."), and the page's runner compares.
STATE_EVERY_OUTPUT = sorted(
  str(path.relative_to(ROOT))
  for path in [ROOT / "README.md", *DOCS.rglob("*.md")]
  if python_blocks(path)
)


@pytest.mark.parametrize("name", STATE_EVERY_OUTPUT)
def test_docs_every_python_block_states_its_output(name):
  unstated = [n for n, shown in enumerate(shown_outputs(ROOT / name), 1) if shown is None]
  assert not unstated, f"{name}: python blocks {unstated} do not say what they print"


def test_docs_quickstart_states_what_each_block_prints():
  outputs = shown_outputs(DOCS / "quickstart.md")
  assert len(outputs) == len(python_blocks(DOCS / "quickstart.md")) == 2
  assert all(outputs), "a quickstart block prints something the page does not show"
  # The NNX step: one clean step at torch's initial scale, which it keeps.
  assert outputs[1].endswith(", scale 65536\n"), outputs[1]


def _table_after(text: str, header: str) -> list[list[str]]:
  """The rows of the Markdown table whose header line is ``header``, as cells."""
  lines = text[text.index(header) :].splitlines()[2:]
  rows = []
  for line in lines:
    if not line.startswith("|"):
      break
    rows.append([cell.strip() for cell in line.strip("|").split(" | ")])
  return rows


def test_docs_grad_scaler_api_table_lists_every_public_name():
  import jaxamp

  rows = _table_after((DOCS / "grad_scaler.md").read_text(), "| torch | jaxamp |")
  spans = [span for _, jaxamp_column in rows for span in re.findall(r"`([^`]+)`", jaxamp_column)]
  words = {word for span in spans for word in re.findall(r"[A-Za-z_]\w*", span)}
  public = {name for name in dir(jaxamp.GradScaler) if not name.startswith("_")}
  assert public, "GradScaler has public names"
  missing = sorted(public - words)
  assert not missing, f"docs/grad_scaler.md's table lacks GradScaler.{missing}"
  # and every scaler.NAME the table shows exists
  shown = {name for span in spans for name in re.findall(r"\bscaler\.([A-Za-z_]\w*)", span)}
  unknown = sorted(shown - set(dir(jaxamp.GradScaler)))
  assert not unknown, f"docs/grad_scaler.md's table shows GradScaler.{unknown}, which it lacks"


def test_docs_readme_links_resolve_and_it_stays_short():
  text = (ROOT / "README.md").read_text()
  links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
  local = [link for link in links if "://" not in link]
  assert local, "the README links into docs/"
  missing = [link for link in local if not (ROOT / link).exists()]
  assert not missing, missing
  assert len(text.splitlines()) <= 150, "the README is a summary: details go into docs/"


def test_docs_index_counts_the_quickstart_lines():
  [count] = re.findall(r"in (\d+) lines of code", (DOCS / "index.md").read_text())
  first = python_blocks(DOCS / "quickstart.md")[0]
  assert int(count) == len([line for line in first.splitlines() if line.strip()])
