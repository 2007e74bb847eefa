"""The figures the docs state come from the code, and a test says when they part.

The parity counts come from the scenario registry (parity/scenarios.py), the
latest report of docs/parity.md and its pictures from ``python -m parity --docs``
(parity/report.py), the install lines from pyproject.toml's extras.
"""

import decimal
import json
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


@pytest.mark.parametrize(
  "page", [*PAGES, ROOT / "BENCHMARKS.md", ROOT / "CHANGELOG.md"], ids=lambda p: p.name
)
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


# Speed figures: every ratio or timing that README.md or docs/ states comes from a
# results file of benchmarks/results/, which a benchmark script writes with its
# command and machine (--json PATH). A paragraph or table that states one ends in,
# or is followed by, <!-- measured: NAME, ... --> naming its files.
RESULTS = ROOT / "benchmarks" / "results"
BENCHMARKS_LOG = ROOT / "BENCHMARKS.md"
MEASURED = re.compile(r"<!-- measured: ([\w, ]+) -->")
NUMBER = r"\d[\d,]*(?:\.\d+)?"
SPEED = re.compile(
  rf"(?<![\w.]){NUMBER}(?:-{NUMBER})?(?:x\b| ?ms\b| s\b| GB/s|% (?:slower|faster))"
)
NOT_FIGURES = {"command", "hardware", "source", "meta", "args", "what"}
# Pages whose timings are not jaxamp's speed: the test suite's and the parity report's run times.
NOT_SPEED_PAGES = {"benchmarks.md", "contributing.md", "parity.md", "underflow.md"}


def _results(name: str) -> dict:
  path = RESULTS / f"{name}.json"
  assert path.exists(), f"benchmarks/results/{name}.json does not exist"
  return json.loads(path.read_text())


def _figures(node, key: str = "") -> list[decimal.Decimal]:
  """Every number of a results file but its command, machine and arguments."""
  if key in NOT_FIGURES or isinstance(node, bool):
    return []
  if isinstance(node, (int, float)):
    return [decimal.Decimal(repr(node))]
  if isinstance(node, dict):
    return [n for k, v in node.items() for n in _figures(v, k)]
  if isinstance(node, list):
    return [n for v in node for n in _figures(v)]
  return []


def _numbers(text: str) -> list[str]:
  return [n.replace(",", "") for n in re.findall(NUMBER, text)]


def _as_written(written: str, figures: list[decimal.Decimal]) -> bool:
  """Whether one of ``figures``, rounded to the digits ``written`` shows, is ``written``."""
  step = decimal.Decimal(1).scaleb(-len(written.partition(".")[2]))
  wanted = decimal.Decimal(written)
  return any(f.quantize(step, rounding=decimal.ROUND_HALF_UP) == wanted for f in figures)


def _sections(text: str) -> list[list[str]]:
  """The page's sections (split at headings), each as its blocks (split at blank
  lines), code blocks left out."""
  lines, in_code = [], False
  for line in text.splitlines():
    if line.startswith("```"):
      in_code = not in_code
    lines.append("" if in_code or line.startswith("```") else line)
  sections, current = [], []
  for line in lines:
    if line.startswith("#"):
      sections.append(current)
      current = []
    current.append(line)
  sections.append(current)
  return [[b for b in "\n".join(s).split("\n\n") if b.strip()] for s in sections]


def _machine_named(hardware: dict, text: str) -> bool:
  cores = hardware["cores"]
  return (f"{cores}-core" in text or f"{cores} cores" in text) and hardware["device"] in text


def _speed_figure_problems(page: pathlib.Path) -> list[str]:
  text = page.read_text()
  sections, lead = _sections(text), text.split("\n## ")[0]  # the lead speaks for the page
  problems = []
  for blocks in sections:
    section = "\n\n".join(blocks)
    for number, block in enumerate(blocks):
      names = MEASURED.findall(block)
      if not names and number + 1 < len(blocks) and MEASURED.fullmatch(blocks[number + 1].strip()):
        names = MEASURED.findall(blocks[number + 1])
      prose = MEASURED.sub("", block)
      stated = [m.group(0) for m in SPEED.finditer(prose)]
      if names and block.startswith("|"):  # a measured table's plain numbers are figures too
        stated += [c for c in re.split(r"\s*\|\s*", prose) if re.fullmatch(r"\d+\.\d+", c)]
      if not stated or MEASURED.fullmatch(block.strip()):
        continue
      where = f"{page.name}: {prose.strip()[:70]!r}"
      if not names:
        problems.append(f"{where} states {stated} without <!-- measured: ... -->")
        continue
      files = [_results(n.strip()) for name in names for n in name.split(",")]
      figures = [f for data in files for f in _figures(data)]
      wrong = [s for s in stated for n in _numbers(s) if not _as_written(n, figures)]
      if wrong:
        problems.append(f"{where}: {wrong} are not in benchmarks/results/{names}")
      for data in files:
        if not any(_machine_named(data["hardware"], t) for t in (block, section, lead)):
          hw = data["hardware"]
          problems.append(
            f"{where} does not name its machine ({hw['cores']} cores, {hw['device']})"
          )
  return problems


@pytest.mark.parametrize(
  "page",
  [p for p in PAGES if p.name not in NOT_SPEED_PAGES],
  ids=lambda p: p.name,
)
def test_doc_figures_speed_figures_come_from_results_files(page):
  problems = _speed_figure_problems(page)
  assert not problems, "\n".join(problems)


def test_doc_figures_speed_check_catches_a_figure_typed_by_hand(tmp_path):
  measured = "<!-- measured: whole_step_batch8 -->"
  cases = {
    "Speed: 0.91-1.12x on 2 cores, XLA CPU.\n" + measured: [],
    "Speed: 0.91-1.12x on 2 cores, XLA CPU.\n": ["without <!-- measured"],
    "Speed: 0.90-1.12x on 2 cores, XLA CPU.\n" + measured: ["['0.90-1.12x'] are not in"],
    "Speed: 0.91-1.12x.\n" + measured: ["does not name its machine"],
  }
  for text, expected in cases.items():
    page = tmp_path / "page.md"
    page.write_text(f"# Page\n\n{text}\n")
    problems = _speed_figure_problems(page)
    assert len(problems) == len(expected), (text, problems)
    assert all(e in p for e, p in zip(expected, problems)), (text, problems)


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda p: p.name)
def test_doc_figures_results_file_names_its_command_and_machine(path):
  data = json.loads(path.read_text())
  hardware = data.get("hardware", {})
  missing = [k for k in ("cpu", "cores", "device", "jax", "date") if not hardware.get(k)]
  assert not missing, f"{path.name}'s hardware lacks {missing}"
  commands = data.get("command")
  commands = [commands] if isinstance(commands, str) else commands
  assert commands, f"{path.name} names no command"
  for command in commands:
    script = re.search(r"python (benchmarks/\w+\.py)", command)
    assert script and (ROOT / script[1]).exists(), (path.name, command)
    assert '"--json"' in (ROOT / script[1]).read_text(), f"{script[1]} cannot write --json"
  assert _figures(data), f"{path.name} holds no figure"


# the results files copied from BENCHMARKS.md; the others were written by their benchmark
FROM_THE_LOG = [p for p in sorted(RESULTS.glob("*.json")) if "source" in json.loads(p.read_text())]


@pytest.mark.parametrize("path", FROM_THE_LOG, ids=lambda p: p.name)
def test_doc_figures_results_file_from_the_log_matches_it(path):
  """A results file copied from BENCHMARKS.md ("source") holds only the log's figures."""
  data = json.loads(path.read_text())
  sources = [data["source"]] if isinstance(data["source"], str) else data["source"]
  log, text = BENCHMARKS_LOG.read_text(), ""
  for source in sources:
    heading = source.split(", ", 1)[1]  # "BENCHMARKS.md, <heading>"
    found = re.search(rf"^(#+) {re.escape(heading)}\n", log, flags=re.MULTILINE)
    assert found, f"{path.name}: BENCHMARKS.md has no heading {heading!r}"
    end = re.search(rf"^#{{1,{len(found[1])}}} ", log[found.end() :], flags=re.MULTILINE)
    text += log[found.end() : found.end() + end.start() if end else len(log)]
  logged = {decimal.Decimal(n) for n in _numbers(text)}
  absent = sorted({str(f) for f in _figures(data) if f not in logged})
  assert not absent, f"{path.name} holds {absent}, which {sources} do not"


def test_doc_figures_benchmark_log_tables_name_script_and_command():
  """Each topic of BENCHMARKS.md with a table names the script and the command that
  measured it; the machine is "The machine"'s unless the topic names another."""
  log = BENCHMARKS_LOG.read_text()
  machine = " ".join(_section(log, "## The machine").split())
  assert "2 cores" in machine and "XLA CPU" in machine and "jax 0.10.2" in machine
  topics = re.split(r"^(?=## )", log, flags=re.MULTILINE)[1:]
  bare = []
  for topic in topics:
    if not re.search(r"^\|", topic, flags=re.MULTILINE):
      continue
    if not re.search(r"benchmarks/\w+\.py", topic) or "python benchmarks/" not in topic:
      bare.append(topic.splitlines()[0])
  assert not bare, f"BENCHMARKS.md topics with a table but no script and command: {bare}"
