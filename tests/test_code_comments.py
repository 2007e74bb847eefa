"""The code explains why, once; BENCHMARKS.md holds the numbers.

A comment or docstring in ``jaxamp/`` that rests on a measurement cites the
topic of BENCHMARKS.md that holds it, as ``(BENCHMARKS.md, "Topic")``, and
states no number of its own: numbers go stale in code, and a diary reference
("Session 9") says when, not why. Every such citation anywhere in the
repository must name a heading of BENCHMARKS.md, so that renaming a topic
fails here instead of leaving a dead reference.
"""

import pathlib
import re

import pytest

import jaxamp

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "BENCHMARKS.md"
# The package under test: the checkout's, or the installed wheel's (scripts/test.sh).
PACKAGE = pathlib.Path(jaxamp.__file__).resolve().parent
# Where the repository's own text lives (not virtual environments or builds).
SOURCES = ["tests", "docs", "benchmarks", "scripts", "examples", "parity"]
SUFFIXES = {".py", ".md", ".sh", ".toml", ".yml"}

# BENCHMARKS.md, "Topic" (a comma or not), across a line break.
CITATION = re.compile(r'BENCHMARKS\.md,?\s+"([^"]+)"')
# A ratio (1.5x, 1.13-1.22x) or a timing (24 ms, 49 MiB, 16 GB/s, 3.5 s).
MEASUREMENT = re.compile(r"\b\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?(?:x|\s?(?:ms|MiB|MB|GB/s|s))\b")


def headings():
  """The headings of BENCHMARKS.md, at any level."""
  return set(re.findall(r"^#+ (.+?)\s*$", BENCHMARKS.read_text(), flags=re.MULTILINE))


def flat(text):
  """``text`` with every run of whitespace one space (and comment markers
  dropped), so a citation wrapped over two comment lines reads as one."""
  return re.sub(r"\s+(?:#\s+)?", " ", text)


def repository_files():
  files = [p for p in ROOT.glob("*") if p.is_file() and p.suffix in SUFFIXES]
  files += [p for p in sorted(PACKAGE.rglob("*")) if p.suffix in SUFFIXES]
  for top in SOURCES:
    files += [p for p in sorted((ROOT / top).rglob("*")) if p.suffix in SUFFIXES]
  # This file's own messages show the citation's form with a placeholder.
  return [p for p in files if p.is_file() and p.resolve() != pathlib.Path(__file__).resolve()]


def _name(path: pathlib.Path) -> str:
  """``path`` relative to the checkout, or to the installed package's parent."""
  base = ROOT if path.is_relative_to(ROOT) else PACKAGE.parent
  return str(path.relative_to(base))


def package_files():
  return sorted(PACKAGE.rglob("*.py"))


def test_citations_find_their_topics():
  # Guards the test itself: it would pass on a repository that cites nothing.
  cited = {topic for p in repository_files() for topic in CITATION.findall(flat(p.read_text()))}
  assert {"Gradient layout", "Check formulations"} <= cited, sorted(cited)
  assert "Gradient layout" in headings()


@pytest.mark.parametrize("path", repository_files(), ids=_name)
def test_every_benchmarks_citation_names_a_heading(path):
  missing = sorted(set(CITATION.findall(flat(path.read_text()))) - headings())
  assert not missing, (
    f"{_name(path)} cites BENCHMARKS.md topics that are not headings of it: "
    f"{missing}; cite one of {sorted(headings())}, or add the topic to BENCHMARKS.md."
  )


def test_benchmarks_cross_references_name_its_headings():
  text = flat(BENCHMARKS.read_text())
  refs = set(re.findall(r'\bsee "([^"]+)"', text))
  refs |= {
    r
    for group in re.findall(r'\bsee ((?:"[^"]+"(?:, | and ))+"[^"]+")', text)
    for r in re.findall(r'"([^"]+)"', group)
  }
  assert refs, "BENCHMARKS.md cross-references nothing: the pattern is out of date"
  missing = sorted(refs - headings())
  assert not missing, f'BENCHMARKS.md says see "X" for topics it has no heading for: {missing}'


@pytest.mark.parametrize("path", package_files(), ids=_name)
def test_jaxamp_cites_topics_not_sessions_or_numbers(path):
  text = path.read_text()
  name = _name(path)
  assert not re.search(r"\bsessions?\b", text, flags=re.IGNORECASE), (
    f"{name} mentions a session: say why in one sentence and cite the "
    f'BENCHMARKS.md topic, (BENCHMARKS.md, "Topic").'
  )
  bare = len(re.findall(r"BENCHMARKS\.md", text)) - len(CITATION.findall(flat(text)))
  assert bare == 0, f'{name} mentions BENCHMARKS.md without a topic: cite (BENCHMARKS.md, "Topic").'
  numbers = MEASUREMENT.findall(text)
  assert not numbers, (
    f"{name} states measurements {numbers}: keep the numbers in BENCHMARKS.md and cite "
    f'the topic, (BENCHMARKS.md, "Topic").'
  )


def test_the_measurement_pattern_sees_what_it_must():
  # The pattern must catch the forms the code once had, and leave code alone.
  for text in ["took 1.13-1.22x its time", "(1.5x at 200 leaves", "24 ms", "49 MiB", "16 GB/s"]:
    assert MEASUREMENT.search(text), text
  for text in ["0x7FFFFFFF", "2**-126", "float16", "x + 1", "jnp.float32(3.4e38)"]:
    assert not MEASUREMENT.search(text), text
