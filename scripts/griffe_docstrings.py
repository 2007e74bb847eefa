"""A griffe extension for the docs site (mkdocs.yml): jaxamp's docstrings, written
for reading in a terminal and for Sphinx-style tools, rendered as Markdown.

- Sphinx roles (``:func:`~jaxamp.get_loss_scale```) become code, linked to the API
  reference when they name a public object (``[`get_loss_scale`][jaxamp.get_loss_scale]``,
  resolved by mkdocs-autorefs); a bare name is looked up in ``jaxamp``.
- reStructuredText literal blocks (a paragraph ending in ``::`` and an indented
  block) become fenced code blocks.
- A page of the docs named by its path in the repository (``docs/speed.md``, a
  reader of ``help()`` has no site), with a section (``docs/x.md §3.2``,
  ``docs/x.md, "Section"``) or not, becomes a relative link from the API pages
  (docs/api/) to that page or section, which mkdocs checks like any other.

The docstrings themselves stay as they are; nothing here runs outside the docs build.
"""

from __future__ import annotations

import ast
import pathlib
import re
import textwrap
import unicodedata
from typing import Any

import griffe

PUBLIC = {
  "jaxamp.flax_utils",
  *(
    f"jaxamp.flax_utils.{name}"
    for name in ("scaled_value_and_grad", "loss_scale_metrics", "update", "apply_gradients")
  ),
}
ROLE = re.compile(r":(?:func|class|meth|attr|data|mod|obj|exc):`(~?)([\w.]+)(?:\(\))?`")


def _public() -> set[str]:
  """``jaxamp.__all__``, read from the source (the docs build does not import jax)."""
  init = pathlib.Path(__file__).resolve().parents[1] / "jaxamp" / "__init__.py"
  for node in ast.parse(init.read_text()).body:
    if isinstance(node, ast.Assign) and any(
      isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
    ):
      return PUBLIC | {f"jaxamp.{name}" for name in ast.literal_eval(node.value)}
  raise RuntimeError(f"no __all__ in {init}")


def _role(match: re.Match[str], public: set[str]) -> str:
  short, name = match.group(1) == "~", match.group(2)
  target = name if name in public else f"jaxamp.{name}"
  shown = name.rsplit(".", 1)[-1] if short else name
  if target in public:
    return f"[`{shown}`][{target}]"
  return f"`{shown}`"


def _literal_blocks(text: str) -> str:
  lines, out, i = text.split("\n"), [], 0
  while i < len(lines):
    line = lines[i]
    if line.rstrip().endswith("::") and i + 1 < len(lines) and not lines[i + 1].strip():
      indent = len(line) - len(line.lstrip())
      j = i + 2
      block = []
      while j < len(lines) and (
        not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > indent
      ):
        block.append(lines[j])
        j += 1
      while block and not block[-1].strip():
        block.pop()
        j -= 1
      if block:
        head = line.rstrip()[:-2].rstrip()
        out.append(head + ":" if head and not head.endswith(":") else head)
        pad = " " * indent
        out += ["", pad + "```text"]
        out += [pad + row for row in textwrap.dedent("\n".join(block)).split("\n")]
        out += [pad + "```"]
        i = j
        continue
    out.append(line)
    i += 1
  return "\n".join(out)


ROOT = pathlib.Path(__file__).resolve().parents[1]


DOCS_PAGE = re.compile(
  r"(``)?docs/(?P<page>[\w/]+)\.md(?(1)``)"
  r"(?P<section> ?§ ?(?P<number>\d+(?:\.\d+)?)|, (?P<quote>[\"'])(?P<name>[^\"'\n]+)(?P=quote))?"
)


def _slug(heading: str) -> str:
  """The anchor Python-Markdown's toc extension gives a heading."""
  text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
  text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
  text = re.sub(r"[^\w\s-]", "", text).strip().lower()
  return re.sub(r"[-\s]+", "-", text)


def _headings(page: str) -> list[str]:
  text = (ROOT / "docs" / f"{page}.md").read_text()
  text = re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)
  return re.findall(r"^#{1,6} +(.+?)\s*$", text, flags=re.MULTILINE)


def _anchor(page: str, number: str | None, name: str | None) -> str:
  """The anchor of ``page``'s section ``number`` (``3.2``; an item such as ``6.15``
  without a heading of its own: its section's) or ``name``; none for the page."""
  headings = _headings(page)
  if name is not None and name.replace("`", "") in [h.replace("`", "") for h in headings]:
    return _slug(next(h for h in headings if h.replace("`", "") == name.replace("`", "")))
  while number:
    for heading in headings:
      if re.match(rf"{re.escape(number)}\.? ", heading):
        return _slug(heading)
    number = number.rpartition(".")[0]
  return ""


def _link_docs_pages(text: str) -> str:
  """``docs/x.md`` (and a section cited after it) as a link, outside code blocks."""

  def link(match: re.Match[str]) -> str:
    page = match.group("page")
    shown = f"docs/{page}.md" + (match.group("section") or "")
    anchor = _anchor(page, match.group("number"), match.group("name"))
    return f"[{shown}](../{page}.md{'#' + anchor if anchor else ''})"

  parts = re.split(r"(^ *```.*?^ *```)", text, flags=re.DOTALL | re.MULTILINE)
  return "".join(
    part if part.lstrip().startswith("```") else DOCS_PAGE.sub(link, part) for part in parts
  )


class SphinxToMarkdown(griffe.Extension):
  """Rewrites each docstring once, when griffe loads the object."""

  def __init__(self) -> None:
    self.public = _public()

  def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
    if obj.docstring is None:
      return
    value = ROLE.sub(lambda m: _role(m, self.public), obj.docstring.value)
    obj.docstring.value = _link_docs_pages(_literal_blocks(value))
