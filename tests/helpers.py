"""Plain helpers shared by the test modules (pytest fixtures live in ``conftest.py``).

pytest puts ``tests/`` (a rootdir folder with a ``conftest.py`` and no
``__init__.py``) on ``sys.path``, so test modules import these as
``from helpers import bits, ...``. Everything here uses jaxamp's public API only.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxamp

# ---------------------------------------------------------------------------------
# Subprocesses.
# ---------------------------------------------------------------------------------


def compilation_cache_env(name: str) -> dict[str, str]:
  """Environment variables that give a test's subprocesses a persistent compilation
  cache of their own, ``name`` under the tests' (tests/conftest.py): a program that
  several of them compile is compiled once per run, and a rerun loads it. Their own
  directory, since JAX's size-limited cache reads every entry before each write
  (the test processes skip that, the subprocesses cannot); empty when the cache is
  off."""
  path = jax.config.jax_compilation_cache_dir
  if not path:
    return {}
  return {
    "JAX_COMPILATION_CACHE_DIR": os.path.join(path, "subprocesses", name),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    # The size limit turns on the cache's file lock: subprocesses run side by side.
    "JAX_COMPILATION_CACHE_MAX_SIZE": str(2**28),
  }


# ---------------------------------------------------------------------------------
# Bits and trees.
# ---------------------------------------------------------------------------------


def bits(tree: Any) -> list[bytes]:
  """The bytes of every leaf of ``tree``: equal lists mean bit-identical trees.

  A bare Python float is a float64 leaf: wrap it (``np.float32(x)``) to compare
  it with a float32 array.
  """
  return [np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(tree)]


def filled(params: Any, value: float = 1.0) -> Any:
  """A tree like ``params`` with every entry ``value`` (each leaf's own dtype)."""
  return jax.tree.map(lambda p: jnp.full(p.shape, value, p.dtype), params)


def normal_tree(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, np.ndarray]:
  """One float64 NumPy array of N(0, 1) draws per entry of ``shapes``, seeded."""
  rng = np.random.default_rng(seed)
  return {k: rng.normal(size=s) for k, s in shapes.items()}


def _leaf_name(path: tuple) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def make_grads(
  base: Any, *, scale: float = 1.0, dtype: Any = None, poison: tuple | None = None
) -> Any:
  """Gradients for a test: every leaf of ``base`` times ``scale`` (in the leaf's own
  precision, then rounded once to ``dtype``; ``None`` keeps jnp's default), and with
  ``poison = (leaf, index, value)`` the entry at flat ``index`` of ``leaf`` (a flat
  leaf number, or a ``/``-joined key path such as ``"encoder/b"``) set to ``value``.
  """
  tree = jax.tree.map(lambda x: jnp.asarray(x * scale, dtype), base)
  if poison is None:
    return tree
  leaf, index, value = poison
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  leaves = [x for _, x in flat]
  if not isinstance(leaf, int):
    leaf = [_leaf_name(path) for path, _ in flat].index(leaf)
  x = leaves[leaf]
  leaves[leaf] = x.reshape(-1).at[index].set(value).reshape(x.shape)
  return jax.tree.unflatten(treedef, leaves)


# ---------------------------------------------------------------------------------
# One suite over both front-ends (as optax's _common_test.py runs one suite over
# many optimizers): dynamic_loss_scale through tx.update, and GradScaler with an
# Optimizer through scale/step/update. Both take the same option names.
# ---------------------------------------------------------------------------------

FRONT_ENDS = ["optax", "grad_scaler"]

PARAMS = {"encoder": {"w": jnp.ones((2, 2)), "b": jnp.ones(2)}, "head": jnp.ones(3)}
# A step flag's poison: -inf in the last entry of the last leaf (PARAMS' head[2]).
FLAG_POISON = (-1, -1, -jnp.inf)


class Step(NamedTuple):
  """The loss-scale state after one step of either front-end."""

  loss_scale: jax.Array  # float32, as held (compare with float() or bits())
  growth_tracker: int
  hysteresis_tracker: int
  found_inf: bool  # optax: state.found_inf; GradScaler: skipped_updates went up
  skipped: jax.Array  # skipped_steps / skipped_updates
  consecutive_skipped: jax.Array  # consecutive_skipped_steps / consecutive_skipped_updates
  update_count: jax.Array
  params: Any  # after the step
  nonfinite_leaf_paths: list[str]
  updates: Any  # the optax updates; None for GradScaler, which has none to show


def _gradient_steps(steps, params):
  clean = filled(params)
  for step in steps:
    if isinstance(step, (bool, int, np.integer, np.bool_)):
      yield make_grads(clean, poison=FLAG_POISON if step else None)
    else:
      yield step


def _run_optax(options, steps, params, inner, jit):
  tx = jaxamp.dynamic_loss_scale(inner, **options)
  state = tx.init(params)

  def step(g, state, params):
    updates, state = tx.update(g, state, params)
    return updates, optax.apply_updates(params, updates), state

  step = jax.jit(step) if jit else step
  out = []
  for g in _gradient_steps(steps, params):
    updates, params, state = step(g, state, params)
    s = jaxamp.ops.find_loss_scale_state(state)
    out.append(
      Step(
        loss_scale=s.loss_scale,
        growth_tracker=int(s.growth_tracker),
        hysteresis_tracker=int(s.hysteresis_tracker),
        found_inf=bool(s.found_inf),
        skipped=s.skipped_steps,
        consecutive_skipped=s.consecutive_skipped_steps,
        update_count=s.update_count,
        params=params,
        nonfinite_leaf_paths=jaxamp.ops.nonfinite_leaf_paths(state, params),
        updates=updates,
      )
    )
  return out


def _grad_scaler_iteration(scaler, opt, g):
  opt.grads = g
  scaler.step(opt)
  scaler.update()
  return scaler, opt


_jitted_grad_scaler_iteration = jax.jit(_grad_scaler_iteration)


def _run_grad_scaler(options, steps, params, inner, jit):
  scaler = jaxamp.GradScaler(**options)
  scaler.scale(jnp.float32(1.0))  # the scaler's methods need a first scale()
  opt = jaxamp.Optimizer(inner, params)
  iteration = _jitted_grad_scaler_iteration if jit else _grad_scaler_iteration
  out, skipped_before = [], 0
  for g in _gradient_steps(steps, params):
    scaler, opt = iteration(scaler, opt, g)
    skipped = int(scaler.skipped_updates)
    out.append(
      Step(
        loss_scale=scaler.loss_scale,
        growth_tracker=scaler._get_growth_tracker(),
        hysteresis_tracker=int(scaler.hysteresis_tracker),
        found_inf=skipped > skipped_before,
        skipped=scaler.skipped_updates,
        consecutive_skipped=scaler.consecutive_skipped_updates,
        update_count=scaler.update_count,
        params=opt.params,
        nonfinite_leaf_paths=scaler.nonfinite_leaf_paths(opt),
        updates=None,
      )
    )
    skipped_before = skipped
  return out


def run_front_end(
  front_end: str,
  options: dict,
  steps: list,
  *,
  params: Any = PARAMS,
  inner: optax.GradientTransformation | None = None,
  jit: bool = True,
) -> list[Step]:
  """Runs one step per entry of ``steps`` through ``front_end`` (one of FRONT_ENDS)
  built with ``options`` (the kwargs both constructors share) around ``inner``
  (default ``optax.sgd(0.1)``); returns the state after each step.

  A step is a gradient tree, or a flag: falsy gives gradients of 1 for ``params``,
  truthy the same with ``FLAG_POISON``. ``jit`` jits each step (``tx.update`` and
  ``apply_updates``; GradScaler's step and update); otherwise they run eagerly.
  """
  inner = optax.sgd(0.1) if inner is None else inner
  run = {"optax": _run_optax, "grad_scaler": _run_grad_scaler}[front_end]
  return run(options, steps, params, inner, jit)


def jitted_unscale_loop(scaler, injections):
  """The README's clipping loop (``unscale_``, then ``step``, ``update``) jitted
  over Adam on a 3-vector, its first gradient multiplied by each injection, no
  host transfer allowed. Returns the scaler, the optimizer, the scale after
  each iteration and the number of traces."""
  opt = jaxamp.Optimizer(optax.adam(0.1), {"w": jnp.array([1.0, -2.0, 3.0])})
  traces = []

  @jax.jit
  def train_step(scaler, opt, x, inject):
    traces.append(1)
    opt.zero_grad()
    opt.grads = jax.grad(lambda p: scaler.scale(jnp.sum((p["w"] * x) ** 2)))(opt.params)
    opt.grads = {"w": opt.grads["w"].at[0].multiply(inject)}
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    return scaler, opt

  x = jnp.array([0.5, 1.0, 1.5])
  scales = []
  with jax.transfer_guard("disallow"):
    for inject in injections:
      scaler, opt = train_step(scaler, opt, x, inject)
      scales.append(scaler.loss_scale)
  return scaler, opt, scales, len(traces)


def needs_workaround(*names: str):
  """Marks a test of an XLA workaround (``jaxamp/_xla``): it is skipped, saying
  so, when ``JAXAMP_XLA_OFF`` turns one of ``names`` off (the plain form has
  nothing of what it tests)."""
  import pytest

  from jaxamp import _xla

  off = [name for name in names if not _xla.enabled(name)]
  return pytest.mark.skipif(
    bool(off), reason=f"tests the XLA workaround {off}, turned off by JAXAMP_XLA_OFF"
  )
