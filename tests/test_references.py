"""Every cross-reference names something that exists, and every argument is described.

What a reader follows: links and anchors in the README and docs/, repository paths
(``docs/x.md``, ``parity/models.py``), sections of torch's semantics cited as
``§3.2``, sections cited by name (``docs/autocast.md, "Nested regions"``), what
"the README's ..." points to, and ``jaxamp.X`` names. They are read from the
README, docs/, the docstrings and comments of jaxamp/, and the parity suite (whose
report prints some of them). BENCHMARKS.md topics are checked by
tests/test_code_comments.py.
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import re
import unicodedata

import pytest

import jaxamp

ROOT = pathlib.Path(__file__).resolve().parents[1]
SEMANTICS = ROOT / "docs" / "torch_semantics.md"


def sources() -> list[pathlib.Path]:
  files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
  files += sorted((ROOT / "jaxamp").rglob("*.py")) + sorted((ROOT / "parity").glob("*.py"))
  return files


def markdown_sources() -> list[pathlib.Path]:
  return [p for p in sources() if p.suffix == ".md"]


def _id(path: pathlib.Path) -> str:
  return str(path.relative_to(ROOT))


def flat(text: str) -> str:
  """Whitespace runs (and comment markers, string-literal seams) as one space, so a
  reference wrapped over two lines of a comment or a string reads as one."""
  text = re.sub(r'"\s*\n\s*"', "", text)
  return re.sub(r"\s+(?:#\s+)?", " ", text)


def without_code_blocks(text: str) -> str:
  return re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)


def slug(heading: str) -> str:
  """The anchor Python-Markdown's toc extension (mkdocs) gives a heading."""
  text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
  text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
  text = re.sub(r"[^\w\s-]", "", text).strip().lower()
  return re.sub(r"[-\s]+", "-", text)


def included(path: pathlib.Path) -> str:
  """``path``'s text with pymdownx.snippets' ``--8<-- "FILE"`` lines replaced by FILE."""
  return re.sub(
    r'^--8<-- "([^"]+)"$',
    lambda m: (ROOT / m.group(1)).read_text(),
    path.read_text(),
    flags=re.MULTILINE,
  )


def headings(path: pathlib.Path) -> list[str]:
  text = without_code_blocks(included(path))
  return re.findall(r"^#{1,6} +(.+?)\s*#*\s*$", text, flags=re.MULTILINE)


def section_names(path: pathlib.Path) -> set[str]:
  """What a citation by name may name: a heading, or the bold lead of a list item."""
  names = {h.replace("`", "") for h in headings(path)}
  bold = re.findall(r"^\s*[-*] \*\*(.+?)\.?\*\*", path.read_text(), flags=re.MULTILINE)
  return names | {b.replace("`", "") for b in bold}


# --- links and anchors ---------------------------------------------------------------

LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("path", markdown_sources(), ids=_id)
def test_markdown_links_and_anchors_resolve(path):
  text = without_code_blocks(path.read_text())
  dead = []
  for target in LINK.findall(text):
    if "://" in target or target.startswith("mailto:"):
      continue
    file, _, anchor = target.partition("#")
    resolved = (path.parent / file).resolve() if file else path
    if not resolved.exists():
      dead.append(f"{target}: no such file")
    elif anchor and resolved.suffix == ".md" and anchor not in map(slug, headings(resolved)):
      dead.append(f"{target}: no heading with anchor #{anchor} in {_id(resolved)}")
  assert not dead, f"{_id(path)} links to what does not exist: {dead}"


# --- repository paths ----------------------------------------------------------------

PATH = re.compile(
  r"(?<![\w/.-])((?:docs|parity|benchmarks|scripts|tests|examples|jaxamp|\.ci)/[\w./-]*\w"
  r"|(?:BENCHMARKS|CHANGELOG|README)\.md|pyproject\.toml|mkdocs\.yml)(?![\w*{<])"
)


# A path in another project's repository, named as such within a few words.
ELSEWHERE = re.compile(r"Flax's|pytorch/pytorch|optax's|torch's")


def named_paths(text: str) -> set[str]:
  named = set()
  for match in PATH.finditer(text):
    around = text[max(0, match.start() - 80) : match.end() + 40]
    if not ELSEWHERE.search(around):
      named.add(match.group(1))
  return named


def _exists(named: str) -> bool:
  """Whether the checkout has ``named``; a ``jaxamp/`` path may also be in the
  package under test (scripts/test.sh tests the installed wheel from a copy
  without ``jaxamp/``)."""
  if (ROOT / named).exists():
    return True
  package = pathlib.Path(jaxamp.__file__).resolve().parent
  return named.startswith("jaxamp/") and (package.parent / named).exists()


@pytest.mark.parametrize("path", sources(), ids=_id)
def test_repository_paths_named_exist(path):
  missing = sorted(p for p in named_paths(path.read_text()) if not _exists(p))
  assert not missing, f"{_id(path)} names files that do not exist: {missing}"


def test_the_path_pattern_finds_what_it_must():
  # Guards the test above: it would pass on a pattern that finds nothing.
  text = "see docs/speed.md, `parity/models.py` and (scripts/docs.sh); https://x.org/docs/a.md"
  assert PATH.findall(text) == ["docs/speed.md", "parity/models.py", "scripts/docs.sh"]
  assert not PATH.findall("docs/*.md, parity_out/parity.png, mydocs/x.md")
  assert not named_paths("Flax's own examples (`examples/wmt/train.py`)")


# --- torch semantics §N.M ------------------------------------------------------------

SECTION_NUMBER = re.compile(r"§ ?(\d+(?:\.\d+)?)")


def semantics_sections() -> set[str]:
  text = SEMANTICS.read_text()
  numbered = re.findall(r"^#{2,4} (\d+(?:\.\d+)?)\.? ", text, flags=re.MULTILINE)
  items = re.findall(r"^- \*\*(\d+\.\d+) ", text, flags=re.MULTILINE)
  return set(numbered) | set(items)


def test_semantics_sections_are_read():
  assert {"1.9", "3.2", "5.4", "6", "6.15"} <= semantics_sections()


@pytest.mark.parametrize("path", sources(), ids=_id)
def test_section_numbers_cited_exist_in_torch_semantics(path):
  cited = set(SECTION_NUMBER.findall(path.read_text()))
  missing = sorted(cited - semantics_sections())
  assert not missing, (
    f"{_id(path)} cites sections of docs/torch_semantics.md that it does not have: "
    f"{['§' + m for m in missing]}"
  )


# --- sections cited by name ----------------------------------------------------------

NAMED_SECTION = re.compile(
  r"""(?<![\w/])((?:docs/)?[a-z_]+\.md|README(?:\.md)?),?\s+(["'])([^"'\n]{2,80})\2"""
)


def _cited_file(name: str) -> pathlib.Path:
  if name.startswith("README"):
    return ROOT / "README.md"
  return ROOT / name if name.startswith("docs/") else ROOT / "docs" / name


@pytest.mark.parametrize("path", sources(), ids=_id)
def test_sections_cited_by_name_exist(path):
  dead = []
  for file, _, section in NAMED_SECTION.findall(flat(path.read_text())):
    target = _cited_file(file)
    if not target.exists():
      dead.append(f'{file}, "{section}": no such file')
    elif section.replace("`", "") not in section_names(target):
      dead.append(f'{file}, "{section}": no such section in {_id(target)}')
  assert not dead, f"{_id(path)} cites sections that do not exist: {dead}"


def test_the_named_section_pattern_finds_what_it_must():
  text = "(docs/autocast.md, \"Nested regions\") and README 'Exactness' and x.md 'Yz'"
  found = [(f, s) for f, _, s in NAMED_SECTION.findall(text)]
  assert found == [("docs/autocast.md", "Nested regions"), ("README", "Exactness"), ("x.md", "Yz")]


# --- "the README's ..." --------------------------------------------------------------


def _readme_has(thing: str) -> bool:
  readme = (ROOT / "README.md").read_text()
  checks = {
    "example": lambda: "```python" in readme,
    "test command": lambda: "scripts/test.sh" in readme,
    "two commands": lambda: "The two commands" in section_names(ROOT / "README.md"),
    "links": lambda: bool(LINK.search(readme)),
  }
  return thing in checks and checks[thing]()


def _said_of_readme(text: str) -> list[str]:
  """What "the README's ..." names in ``text`` that the README does not have."""
  known = ("example", "test command", "two commands", "links")
  unknown = []
  for phrase in re.findall(r"the README's ([\w -]+)", flat(text)):
    thing = next((k for k in known if phrase.startswith(k)), phrase)
    if not _readme_has(thing):
      unknown.append(phrase)
  return unknown


@pytest.mark.parametrize("path", sources(), ids=_id)
def test_what_the_readme_is_said_to_have_it_has(path):
  wrong = _said_of_readme(path.read_text())
  assert not wrong, f"{_id(path)} refers to the README's {wrong}, which it does not have"


# --- jaxamp names --------------------------------------------------------------------

NAME = re.compile(r"(?<![\w/.-])jaxamp(?:\.[A-Za-z_]\w*)+")
FILE_SUFFIXES = (".md", ".py", ".png", ".json", ".toml", ".txt")
PLACEHOLDERS = {"NAME", "X"}  # jaxamp.NAME, jaxamp.X: a name to fill in


def resolve(dotted: str) -> bool:
  parts = dotted.split(".")
  for split in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module(".".join(parts[:split]))
    except ImportError:
      continue
    for attribute in parts[split:]:
      if not hasattr(obj, attribute):
        return False
      obj = getattr(obj, attribute)
    return True
  return False


@pytest.mark.parametrize("path", sources(), ids=_id)
def test_jaxamp_names_mentioned_exist(path):
  pytest.importorskip("flax")
  names = {n for n in NAME.findall(path.read_text()) if not n.endswith(FILE_SUFFIXES)}
  names = {n for n in names if n.rsplit(".", 1)[-1] not in PLACEHOLDERS}
  missing = sorted(n for n in names if not resolve(n))
  assert not missing, f"{_id(path)} names jaxamp objects that do not exist: {missing}"


def test_the_name_resolver_can_fail():
  assert resolve("jaxamp.ops.unscale_and_check") and resolve("jaxamp.GradScaler.unscale_")
  assert not resolve("jaxamp.unscale_and_check") and not resolve("jaxamp.ops.no_such_name")


# --- every argument described --------------------------------------------------------

# An entry that only points at another one describes nothing.
BACK_REFERENCE = re.compile(r"^(?:as|same as|see|like) `?\w+`?\.?$", flags=re.IGNORECASE)


def public_callables():
  pytest.importorskip("flax")
  from jaxamp import flax_utils, ops

  found = {}
  for module in (jaxamp, ops, flax_utils):
    names = getattr(module, "__all__", None) or [
      n
      for n, v in vars(module).items()
      if inspect.isfunction(v) and v.__module__ == module.__name__ and not n.startswith("_")
    ]
    for name in names:
      value = getattr(module, name)
      if inspect.ismodule(value):
        continue
      found[f"{module.__name__}.{name}"] = value
      if inspect.isclass(value):
        for attribute, member in vars(value).items():
          if not attribute.startswith("_") and inspect.isfunction(member):
            found[f"{module.__name__}.{name}.{attribute}"] = member
  return found


def documented_arguments(doc: str) -> dict[str, str]:
  """The entries of a Google-style ``Args:`` section: name -> description."""
  header = r"^( *)(?:Args|Arguments|Attributes):\n(.*?)(?=^\1\S|\Z)"
  match = re.search(header, doc, flags=re.MULTILINE | re.DOTALL)
  if not match:
    return {}
  body = inspect.cleandoc("\n" + match.group(2))
  entries = re.findall(r"^(\**\w+)(?: \([^)]*\))?:(.*(?:\n .*)*)", body, flags=re.MULTILINE)
  return {name.lstrip("*"): " ".join(text.split()) for name, text in entries}


def test_documented_arguments_reads_google_style():
  doc = "Sums.\n\n  Args:\n    a: the first\n      line two.\n    **kw: forwarded.\n\n"
  doc += "  Returns:\n    x\n"
  assert documented_arguments(doc) == {"a": "the first line two.", "kw": "forwarded."}


@pytest.mark.parametrize(
  "name", sorted(public_callables()) if importlib.util.find_spec("flax") else []
)
def test_public_functions_describe_every_argument(name):
  value = public_callables()[name]
  doc = inspect.getdoc(value) or ""
  try:
    signature = inspect.signature(value)
  except (TypeError, ValueError):
    pytest.skip(f"{name} has no signature")
  parameters = [p for p in signature.parameters if p not in ("self", "cls")]
  if inspect.isclass(value):
    doc = doc + "\n" + (inspect.getdoc(value.__init__) or "")
  entries = documented_arguments(doc)
  undocumented = [p for p in parameters if not entries.get(p)]
  assert not undocumented, f"{name}: no Args entry for {undocumented}"
  vague = [p for p in parameters if BACK_REFERENCE.match(entries[p])]
  assert not vague, f"{name}: the Args entries of {vague} only point at another argument"
