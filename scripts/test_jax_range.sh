#!/usr/bin/env bash
# The oldest end of the JAX range that pyproject.toml states, tested: builds
# .venv-jax-oldest with jax and jaxlib at the lower bound of pyproject.toml's
# `jax>=` and optax at its `optax>=` (both read from pyproject.toml, so the
# stated range and the tested one cannot drift apart), torch at the test extra's
# pin (the core tests compare with it live), and runs the core tests against
# the checkout. The newest end is the JAX that the main test command
# (scripts/test.sh, the README's) installs: CI runs both (.ci/run).
#
# Not run here: the Flax tests. The flax extra (flax>=0.12.8) needs jax>=0.10,
# so Flax is tested with the newest JAX only.
#
# The environment is reused while its jax and optax are the bounds; arguments
# go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv-jax-oldest"

read -r jax_min optax_min torch_pin < <(python3 -c '
import re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
def lower(name):
  (req,) = [r for r in project["dependencies"] if re.match(name + r"\b", r)]
  return re.search(r">=\s*([0-9][0-9.]*)", req).group(1)
(torch,) = [r for r in project["optional-dependencies"]["test"] if r.startswith("torch")]
print(lower("jax"), lower("optax"), torch)
')

if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
installed="$("$venv/bin/python" -c 'import jax, optax; print(jax.__version__, optax.__version__)' \
  2>/dev/null || true)"
if [ "$installed" != "$jax_min $optax_min" ]; then
  "$venv/bin/python" -m pip install --quiet --upgrade pip >/dev/null
  "$venv/bin/python" -m pip install --quiet "jax==$jax_min" "jaxlib==$jax_min" \
    "optax==$optax_min" "$torch_pin" numpy "pytest>=8" pytest-xdist hypothesis
fi
echo "JAX range, oldest end: jax $jax_min, optax $optax_min (pyproject.toml's lower bounds)"

workers="$("$venv/bin/python" -c 'import os; print(min(8, len(os.sched_getaffinity(0))))')"
# python -m pytest puts the checkout first on sys.path: the tests import its jaxamp.
"$venv/bin/python" -m pytest -p no:cacheprovider -q -n "$workers" \
  tests/test_scale_update.py tests/test_unscale.py tests/test_transform.py \
  tests/test_exact.py tests/test_jax_internals.py tests/test_grad_scaler.py \
  --deselect tests/test_transform.py::test_dynamic_loss_scale_with_nnx_optimizer \
  --deselect tests/test_transform.py::test_dynamic_loss_scale_with_train_state \
  "$@"
