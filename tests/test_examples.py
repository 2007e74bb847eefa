"""The examples run end to end, briefly (CI-sized), and their extra installs what they import."""

import ast
import importlib
import importlib.metadata
import pathlib
import sys
import tomllib

import numpy as np
import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from test_docs import shown_outputs

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
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
  docs = (ROOT / "docs" / "flax.md").read_text()
  blocks, outputs = _python_blocks(docs), shown_outputs(ROOT / "docs" / "flax.md")
  assert len(blocks) == len(outputs) == 5
  printed = []
  for number, (block, shown) in enumerate(zip(blocks, outputs), 1):
    capsys.readouterr()
    # Running the documented code as written is the test.
    exec(compile(block, "docs/flax.md", "exec"), {})  # noqa: S102
    printed.append(capsys.readouterr().out)
    assert shown is not None, f"flax.md, python block {number}, does not say what it prints"
    assert printed[-1] == shown, (
      f"flax.md, python block {number}, shows another output than it prints"
    )
  # the NNX and linen loops: three steps at the default scale, none skipped
  assert [out.split(", ")[1:] for out in printed[1:3]] == [["scale 65536.0", "skipped 0\n"]] * 2
  # the restored checkpoint: 1024 halved by the skipped step (torch's backoff 0.5),
  # then one clean step of torch's default interval
  restored = ast.literal_eval(printed[3])
  assert restored == {
    "scale": 512.0,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 2000,
    "_growth_tracker": 1,
  }


def _requirements(extra: str | None = None) -> list[Requirement]:
  """pyproject.toml's requirements: the core ones, or those of ``extra``."""
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  lines = project["optional-dependencies"][extra] if extra else project["dependencies"]
  return [Requirement(line) for line in lines]


def _installed_closure(requirements: list[Requirement]) -> set[str]:
  """The distributions these requirements install, read from the installed
  packages' metadata (no network): each one's own requirements, markers
  evaluated for this interpreter with no extra selected."""
  environment = {**default_environment(), "extra": ""}
  seen: set[str] = set()
  pending = [r for r in requirements if r.marker is None or r.marker.evaluate(environment)]
  while pending:
    requirement = pending.pop()
    name = canonicalize_name(requirement.name)
    if name in seen:
      continue
    seen.add(name)
    try:
      requires = importlib.metadata.requires(requirement.name) or []
    except importlib.metadata.PackageNotFoundError:
      pytest.fail(f"{requirement.name} is not installed: install the test extra to run this test")
    for line in requires:
      child = Requirement(line)
      if child.marker is None or child.marker.evaluate(environment):
        pending.append(child)
  return seen


def test_examples_extra_does_not_pull_torch():
  examples = _requirements("examples")
  assert "torch" not in {canonicalize_name(r.name) for r in examples}
  closure = _installed_closure(examples)
  assert {"flax", "equinox", "scikit-learn"} <= closure  # the walk follows requirements
  assert not {name for name in closure if name.startswith("torch")}, sorted(closure)


def _imported_modules(path: pathlib.Path) -> set[str]:
  modules = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      modules.update(alias.name.split(".")[0] for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      modules.add(node.module.split(".")[0])
  return modules


def test_examples_extra_installs_what_the_examples_import():
  files = sorted(EXAMPLES.rglob("*.py"))
  local = {path.stem for path in files}  # examples/_digits.py, examples/nanogpt/model.py
  third_party = {
    module
    for path in files
    for module in _imported_modules(path)
    if module not in sys.stdlib_module_names and module not in local and module != "jaxamp"
  }
  assert {"flax", "equinox", "sklearn", "matplotlib", "tqdm"} <= third_party
  provided = {canonicalize_name(r.name) for r in _requirements() + _requirements("examples")}
  distributions = importlib.metadata.packages_distributions()
  missing = {
    module
    for module in third_party
    if not {canonicalize_name(d) for d in distributions.get(module, [])} & provided
  }
  assert not missing, f"examples/ imports {sorted(missing)}, which the examples extra lacks"
