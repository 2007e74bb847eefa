#!/usr/bin/env bash
# The test suite, run against the package as it ships: builds the sdist and the
# wheel (python -m build: the wheel is built from the sdist), checks them
# (scripts/check_dist.py: py.typed, no tests or benchmarks, the version), installs
# the WHEEL with the test extra into .venv-wheel, and runs the whole suite (tests/
# and the doctests of the installed jaxamp/) from a copy of the repository without
# jaxamp/, so that `import jaxamp` can only find the installed package (checked:
# JAXAMP_EXPECT_INSTALLED makes tests/test_packaging.py assert it).
#
# One command for both purposes: CI (.ci/run, a clean checkout, so .venv-wheel is
# created from scratch) runs exactly this, the README's test command, and so
# tests the wheel once instead of the checkout and then the wheel. Locally
# .venv-wheel is kept between runs and jaxamp is reinstalled from the new wheel
# each time. Arguments go to pytest, relative to the repository root
# (bash scripts/test.sh tests/test_readme.py -x).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv-wheel"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --upgrade pip build >/dev/null

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$venv/bin/python" -m build --outdir "$work/dist" . >"$work/build.log" 2>&1 || {
  cat "$work/build.log"
  exit 1
}
"$venv/bin/python" scripts/check_dist.py "$work/dist"
wheel="$(ls "$work"/dist/*.whl)"
"$venv/bin/python" -m pip install --quiet "$wheel[test]"
"$venv/bin/python" -m pip install --quiet --force-reinstall --no-deps "$wheel"

# The repository's files but jaxamp/ (git's list where there is one).
mkdir "$work/repo"
if git -C "$root" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  git -C "$root" ls-files -z --cached --others --exclude-standard | grep -zv '^jaxamp/' |
    (cd "$root" && xargs -0 cp --parents -t "$work/repo" 2>/dev/null || true)
else
  tar -C "$root" --exclude=./jaxamp --exclude='./.venv*' -cf - . | tar -C "$work/repo" -xf -
fi
# The torch reference beside the checkout (as CI has it), beside the copy too, so
# that tests/test_fixtures.py compares the vendored fixtures with it.
if [ -d "$root/../shared" ]; then
  ln -s "$(cd "$root/../shared" && pwd)" "$work/shared"
fi
cd "$work/repo"
# -P: not the current directory first on sys.path; there is no jaxamp/ here anyway.
installed="$("$venv/bin/python" -P -c 'import jaxamp, os; print(os.path.dirname(jaxamp.__file__))')"
run_pytest() {
  JAXAMP_EXPECT_INSTALLED="$installed" "$venv/bin/python" -m pytest -p no:cacheprovider \
    --rootdir "$work/repo" "$@"
}
if [ "$#" -gt 0 ]; then
  run_pytest "$@"
else
  # The whole suite: tests/, then the doctests of the installed jaxamp/. Two runs:
  # given both paths at once, pytest reaches site-packages through .venv-wheel,
  # a directory it does not recurse into (norecursedirs '.*'), and collects none.
  status=0
  run_pytest tests || status=$?
  run_pytest "$installed" || status=$((status ? status : $?))
  exit "$status"
fi
