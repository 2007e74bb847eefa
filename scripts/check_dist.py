"""Checks the sdist and wheel that scripts/test.sh built: python scripts/check_dist.py DIST_DIR.

The wheel holds jaxamp/ with py.typed and nothing else of the repository (no tests,
benchmarks, parity suite, examples or docs); its metadata's version, and the
sdist's name, carry jaxamp.__version__ (read from the source, which pyproject.toml
reads too).
"""

import ast
import email.parser
import pathlib
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def source_version() -> str:
  tree = ast.parse((ROOT / "jaxamp" / "__init__.py").read_text())
  for node in tree.body:
    if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [
      "__version__"
    ]:
      return ast.literal_eval(node.value)
  raise SystemExit("no __version__ in jaxamp/__init__.py")


def main(dist: pathlib.Path) -> None:
  version = source_version()
  wheels = sorted(dist.glob("*.whl"))
  sdists = sorted(dist.glob("*.tar.gz"))
  assert len(wheels) == 1 and len(sdists) == 1, f"expected one wheel and one sdist in {dist}"
  assert sdists[0].name == f"jax_gradscaler-{version}.tar.gz", sdists[0].name
  with zipfile.ZipFile(wheels[0]) as wheel:
    names = wheel.namelist()
    info = [n for n in names if n.endswith(".dist-info/METADATA")]
    assert len(info) == 1, info
    metadata = email.parser.Parser().parsestr(wheel.read(info[0]).decode())
  assert metadata["Name"] == "jax-gradscaler", metadata["Name"]
  assert metadata["Version"] == version, (metadata["Version"], version)
  assert "jaxamp/py.typed" in names, "the wheel lacks jaxamp/py.typed"
  top = {n.split("/", 1)[0] for n in names}
  stray = top - {"jaxamp", info[0].split("/", 1)[0]}
  assert not stray, f"the wheel holds more than jaxamp/: {sorted(stray)}"
  modules = [n for n in names if n.startswith("jaxamp/")]
  assert not [n for n in modules if "test" in n.rsplit("/", 1)[-1]], "tests in the wheel"
  print(f"{wheels[0].name}: version {version}, {len(modules)} files under jaxamp/, py.typed")


if __name__ == "__main__":
  main(pathlib.Path(sys.argv[1]))
