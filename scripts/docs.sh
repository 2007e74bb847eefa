#!/usr/bin/env bash
# Builds the documentation site into site/ with warnings as errors (mkdocs.yml
# sets strict: a broken link, a page missing from the nav or a docstring griffe
# cannot parse fails the build). Creates .venv-docs with the docs extra on its
# first run; the docs tools do not import jaxamp (mkdocstrings reads the source),
# so they live in their own small environment. Arguments go to mkdocs build.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
if [ ! -x .venv-docs/bin/python ]; then
  python3 -m venv .venv-docs
fi
.venv-docs/bin/python -m pip install --quiet --upgrade pip >/dev/null
# The docs extra only, read from pyproject.toml: jax and optax (the package's
# own dependencies) stay out of this environment.
mapfile -t requirements < <(.venv-docs/bin/python -c '
import tomllib
for r in tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["docs"]:
  print(r)
')
.venv-docs/bin/python -m pip install --quiet "${requirements[@]}"
NO_MKDOCS_2_WARNING=1 exec .venv-docs/bin/mkdocs build --strict "$@"
