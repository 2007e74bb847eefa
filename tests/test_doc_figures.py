"""The figures the docs state come from the code, and a test says when they part.

The parity counts come from the scenario registry (parity/scenarios.py), the
latest report of docs/parity.md and its pictures from ``python -m parity --docs``
(parity/report.py), the install lines from pyproject.toml's extras.
"""

import pathlib
import re
import struct
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
API_COLUMN = {"optax": "dynamic_loss_scale", "grad_scaler": "GradScaler"}


@pytest.fixture(scope="module")
def registry():
  pytest.importorskip("torch")  # parity/models.py builds torch modules
  from parity.scenarios import REGISTRY

  return REGISTRY


@pytest.fixture(scope="module")
def runs(registry):
  from parity.__main__ import _APIS

  return [(s.name, api) for s in registry.values() for api in _APIS if api in s.apis]


def _counts(text: str, noun: str) -> list[int]:
  """Every number written just before ``noun`` ("49 scenarios", "92 of 92 runs"),
  not the tail of a word ("float16 runs")."""
  pattern = rf"(?<![\w.,-])(\d[\d,]*)(?: of (\d[\d,]*))? {noun}\b"
  return [int(n.replace(",", "")) for match in re.findall(pattern, text) for n in match if n]


def _latest_report() -> str:
  from parity.report import DOCS_BEGIN, DOCS_END

  text = (DOCS / "parity.md").read_text()
  return text[text.index(DOCS_BEGIN) : text.index(DOCS_END)]


def _report_rows(section: str) -> list[list[str]]:
  """The rows of the report's text table: scenario, api, ..., verdict."""
  [table] = re.findall(r"^```text\n(.*?)^```", section, flags=re.DOTALL | re.MULTILINE)
  lines = table.splitlines()
  assert lines[0].split()[:2] == ["scenario", "api"] and set(lines[1]) <= {"-", " "}
  rows = []
  for line in lines[2:]:
    if not line:
      break
    rows.append(line.split())
  return rows


def test_doc_figures_scenario_counts_match_the_registry(registry):
  found = {page.name: _counts(page.read_text(), "scenarios") for page in PAGES}
  assert found["README.md"] and found["parity.md"], "the README and parity.md state the count"
  wrong = {name: counts for name, counts in found.items() if set(counts) - {len(registry)}}
  assert not wrong, f"parity/scenarios.py has {len(registry)} scenarios; the docs say {wrong}"


def test_doc_figures_run_counts_match_the_registry(runs):
  # Other pages' runs are other things (benchmark repeats); these two count parity runs.
  for page in (ROOT / "README.md", DOCS / "parity.md"):
    counts = _counts(page.read_text(), "runs")
    assert set(counts) <= {len(runs)}, f"{page.name}: {counts}, the registry gives {len(runs)}"
  assert _counts((DOCS / "parity.md").read_text(), "runs"), "parity.md states the run count"


def test_doc_figures_latest_report_shows_every_run(registry, runs):
  section = _latest_report()
  rows = _report_rows(section)
  api_of = {column: api for api, column in API_COLUMN.items()}
  assert [(row[0], api_of[row[1]]) for row in rows] == runs, (
    "docs/parity.md's latest report is not a run of every scenario: "
    "python -m parity --png docs/parity.png --docs docs/parity.md"
  )
  passed = sum(row[-1] == "PASS" for row in rows)
  assert f"\n{passed} of {len(runs)} runs match torch.\n" in section
  seconds = re.search(rf"\n{len(runs)} runs in (\d+) s\.\n```", section)
  assert seconds, "the table ends with the runs and their time, as python -m parity prints"
  assert f": {len(registry)} scenarios, {len(runs)} runs in {seconds[1]} s." in section


def test_doc_figures_latest_report_largest_differences_are_the_tables(runs):
  """The summary under the table is the table's own maxima, per pair of tolerances."""
  section = _latest_report()
  largest: dict[tuple[str, str], list[float]] = {}
  for row in _report_rows(section):
    # ... param diff / param tol  state diff / state tol  verdict
    param, param_tol, state, state_tol = row[-7], row[-5], row[-4], row[-2]
    maxima = largest.setdefault((param_tol, state_tol), [0.0, 0.0])
    maxima[0], maxima[1] = max(maxima[0], float(param)), max(maxima[1], float(state))
  summary = re.findall(r"^\| (\S+) / (\S+) \| .* \| (\S+) / (\S+) \|$", section, flags=re.MULTILINE)
  assert {(p, s): [float(a), float(b)] for p, s, a, b in summary} == largest


def test_doc_figures_scenarios_table_lists_every_scenario(registry):
  text = (DOCS / "parity.md").read_text()
  lines = text[text.index("| scenario | steps |") :].splitlines()[2:]
  apis = {"both": {"optax", "grad_scaler"}, "optax": {"optax"}, "GradScaler": {"grad_scaler"}}
  listed = []
  for line in lines:
    if not line.startswith("|"):
      break
    first, steps, _, api = (cell.strip() for cell in line.strip("|").split(" | "))
    names = re.findall(r"`(\w+)`", first.split(" (")[0])
    counts = [int(n.split()[0]) for n in steps.split(", ")]
    counts = counts * len(names) if len(counts) == 1 else counts
    for name, count in zip(names, counts, strict=True):
      assert name in registry, f"docs/parity.md lists {name}, which parity/scenarios.py lacks"
      assert count == registry[name].steps, (name, count)
      assert apis[api] == set(registry[name].apis), (name, api)
      listed.append(name)
  assert sorted(listed) == sorted(registry), set(registry) ^ set(listed)


def _png_text(path: pathlib.Path) -> dict[str, str]:
  """The PNG's tEXt chunks (matplotlib writes its ``metadata`` there)."""
  data = path.read_bytes()
  assert data[:8] == b"\x89PNG\r\n\x1a\n", path
  chunks, offset = {}, 8
  while offset < len(data):
    (length,) = struct.unpack(">I", data[offset : offset + 4])
    kind, body = data[offset + 4 : offset + 8], data[offset + 8 : offset + 8 + length]
    if kind == b"tEXt":
      key, _, value = body.partition(b"\0")
      chunks[key.decode("latin-1")] = value.decode("latin-1")
    offset += 12 + length
  return chunks


@pytest.mark.parametrize("name", ["parity.png", "parity_steps.png"])
def test_doc_figures_parity_pictures_draw_every_scenario(name, registry):
  description = _png_text(DOCS / name).get("Description", "")
  assert description.startswith("parity scenarios: "), f"docs/{name} was not drawn by the report"
  assert description.split(": ", 1)[1].split() == list(registry), (
    f"docs/{name} does not draw every scenario: "
    "python -m parity --png docs/parity.png --docs docs/parity.md"
  )


def _section(text: str, heading: str) -> str:
  start = text.index(f"\n{heading}\n")
  end = text.find("\n## ", start + 1)
  return text[start : end if end >= 0 else len(text)]


def test_doc_figures_install_sections_name_every_extra():
  extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
  sections = {
    name: _section((ROOT / name).read_text(), "## Install")
    for name in ("README.md", "docs/quickstart.md")
  }
  for name, section in sections.items():
    missing = [e for e in extras if f'".[{e}]"' not in section and f"`{e}`" not in section]
    assert not missing, f"{name}'s Install section does not say what {missing} add"
  readme, quickstart = (
    re.findall(r"^```bash\n(.*?)^```", s, flags=re.DOTALL | re.MULTILINE) for s in sections.values()
  )
  assert readme == quickstart, "the README and the quickstart install differently"


def test_doc_figures_no_install_from_the_package_index():
  """jaxamp is not on PyPI yet (and PyPI's jaxamp is another package): every
  install line installs from a checkout."""
  for page in PAGES:
    for line in re.findall(r"pip install [^\n`#]*", page.read_text()):
      assert "jax-gradscaler" not in line and not re.search(r"\bjaxamp\b", line), (page, line)


INTERNAL = [r"not_drawn", r"device tool", r"\bissues? #?\d+", r"closing note", r"\bsessions? \d"]


@pytest.mark.parametrize("page", [*PAGES, ROOT / "BENCHMARKS.md"], ids=lambda p: p.name)
def test_doc_figures_pages_name_no_internal_process(page):
  """The docs speak to users: no status words of the team's tools, no tracker numbers."""
  text = page.read_text()
  found = [m.group(0) for pattern in INTERNAL for m in re.finditer(pattern, text, re.IGNORECASE)]
  assert not found, f"{page.name}: {found}"


def _result(scenario: str, api: str, param_diff: float):
  from parity.engine import Result

  return Result(scenario, api, steps=3, param_rtol=1e-5, state_rtol=1e-5, max_param_diff=param_diff)


def test_doc_figures_report_rewrites_only_its_section(registry, tmp_path):
  from parity import report

  page = tmp_path / "parity.md"
  before, after = "# Parity\n\nprose before\n\n", "\n\nprose after\n"
  page.write_text(f"{before}{report.DOCS_BEGIN}\nold report\n{report.DOCS_END}{after}")
  results = [_result("a", "optax", 2e-7), _result("a", "grad_scaler", 3e-7)]
  for _ in range(2):  # a second run replaces the first one's section
    report.write_docs(results, page, "somewhere")
    text = page.read_text()
    assert text.startswith(before + report.DOCS_BEGIN) and text.endswith(report.DOCS_END + after)
    assert text.count(report.DOCS_BEGIN) == 1 and "old report" not in text
    assert "on somewhere: 1 scenarios, 2 runs in 0 s." in text
    assert "\n2 of 2 runs match torch.\n" in text
    assert "| 1e-05 / 1e-05 | `a` | 3.0e-07 / 0.0e+00 |" in text


@pytest.mark.parametrize(
  "args, content",
  [
    (["--scenario", "linear_defaults"], None),  # a partial run
    (["--api", "optax"], None),
    ([], "# no markers\n"),
  ],
  ids=["scenario", "api", "no_markers"],
)
def test_doc_figures_parity_refuses_to_write_a_partial_or_unmarked_report(
  registry, tmp_path, capsys, args, content
):
  from parity import report
  from parity.__main__ import main

  page = tmp_path / "parity.md"
  page.write_text(content or f"{report.DOCS_BEGIN}\n{report.DOCS_END}\n")
  original = page.read_text()
  assert main([*args, "--docs", str(page), "--no-png", "--no-progress"]) == 2  # before any run
  assert page.read_text() == original
  assert capsys.readouterr().err.startswith("parity: ")
