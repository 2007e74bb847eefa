"""Every ```python block of the README and of docs/ runs as a test.

Most documents are run by the tests next to their subject (COVERED_ELSEWHERE);
this file runs the others, in order, one namespace per document (a reader pastes
them into one session), and checks that no document with a python block is left
out. A block that cannot run as written (torch and jaxamp side by side, a
fragment) is a ```text block.
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
}
RUN_HERE = [
  "docs/quickstart.md",
  "docs/grad_scaler.md",
  "docs/speed.md",
  "docs/optax.md",
  "docs/autocast.md",
]


def python_blocks(path):
  """The ```python blocks of ``path``, in order."""
  return re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.DOTALL | re.MULTILINE)


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
def test_docs_python_blocks_run_in_order(name):
  pytest.importorskip("flax")
  path = ROOT / name
  blocks = python_blocks(path)
  assert blocks, f"{name} has no python block"
  namespace = {"__name__": f"docs_{path.stem}"}
  for number, block in enumerate(blocks, 1):
    # Running the documented code as written is the test.
    exec(compile(block, f"{name} (python block {number})", "exec"), namespace)  # noqa: S102


def test_docs_readme_links_resolve_and_it_stays_short():
  text = (ROOT / "README.md").read_text()
  links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
  local = [link for link in links if "://" not in link]
  assert local, "the README links into docs/"
  missing = [link for link in local if not (ROOT / link).exists()]
  assert not missing, missing
  assert len(text.splitlines()) <= 150, "the README is a summary: details go into docs/"
