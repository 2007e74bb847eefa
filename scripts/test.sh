#!/usr/bin/env bash
# The test suite, run against the package as it ships: builds the sdist and the
# wheel (python -m build: the wheel is built from the sdist), checks them
# (scripts/check_dist.py: py.typed, no tests or benchmarks, the version), installs
# the test extra and then the WHEEL into .venv, and runs the whole suite (tests/
# and the doctests of the installed jaxamp/) from a copy of the repository without
# jaxamp/, so that `import jaxamp` can only find the installed package (checked:
# JAXAMP_EXPECT_INSTALLED makes tests/test_packaging.py assert it). The tests run
# in parallel, one pytest-xdist worker per CPU core (at most 8).
#
# .venv is the environment of parity.sh and lint.sh too (scripts/_venv.sh): torch
# is installed once. This command replaces their editable install of jaxamp with
# the wheel; they put it back. CI (.ci/run, a clean checkout) runs exactly this,
# the README's test command.
#
# Arguments go to pytest. Without a path among them they apply to the whole suite:
# `bash scripts/test.sh -m "not slow"` is the contributors' inner loop
# (docs/contributing.md). A path (a file or directory of the repository, or a test
# id in one) runs just that: `bash scripts/test.sh tests/test_readme.py -x`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
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
# pip keeps an installed jaxamp of the same version (the editable one of parity.sh,
# or an older wheel): replace it with this wheel.
"$venv/bin/python" -m pip install --quiet --force-reinstall --no-deps "$wheel"

# The repository's files but jaxamp/ (git's list where there is one), and no
# virtual environment (an old .venv-wheel, now unused, is not ignored by git).
mkdir "$work/repo"
if git -C "$root" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  git -C "$root" ls-files -z --cached --others --exclude-standard |
    grep -zv -e '^jaxamp/' -e '^\.venv' |
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

# A path among the arguments: pytest runs what it names. None: the whole suite,
# tests/ and the installed jaxamp/ (its doctests), with the arguments as options.
paths=()
for arg in "$@"; do
  if [ -e "$work/repo/${arg%%::*}" ]; then
    paths=("$arg")
    break
  fi
done
if [ "${#paths[@]}" -eq 0 ]; then
  set -- tests "$installed" "$@"
fi
workers="$("$venv/bin/python" -c 'import os; print(min(8, len(os.sched_getaffinity(0))))')"
# --dist worksteal: each worker takes a contiguous share of the tests (a module's
# shared fixtures and caches stay on one worker) and, once done, steals from the
# other's queue, so that no worker idles while a long test file finishes.
# -c: pytest would look for its configuration above the arguments' common
# directory, which is not the copy once the installed jaxamp/ is one of them.
# Not exec: the trap removes $work when pytest is done.
JAXAMP_EXPECT_INSTALLED="$installed" "$venv/bin/python" -m pytest -p no:cacheprovider \
  -c "$work/repo/pyproject.toml" --rootdir "$work/repo" -n "$workers" --dist worksteal "$@"
