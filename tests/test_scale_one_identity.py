"""At scale 1 with finite gradients, a jitted ``dynamic_loss_scale(tx)`` returns
exactly what ``jax.jit(tx.update)`` returns, bit for bit, for every optimizer of
optax's contract suite (tests/test_optax_contract.py), through its ``lax.cond``
and through its in-place loop; and optax's own
``test_optimization`` (10,000 steps on a parabola and on Rosenbrock's function),
vendored with that suite, passes with every optimizer wrapped.
"""

import contextlib
import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from absl.testing import absltest, parameterized
from optax._src import test_utils, update
from test_optax_contract import (
  _OPTIMIZERS_UNDER_TEST,
  _assert_refuses_complex,
  _get_opt,
  _setup_parabola,
  _setup_rosenbrock,
  _unwrapped_opt,
)

from jaxamp import _xla
from jaxamp._xla import in_place as in_place_loop

# Read before tests/conftest.py sets it to 0 for each test.
SMALL_BYTES = in_place_loop.SMALL_BYTES

pytestmark = pytest.mark.slow


@functools.partial(jax.jit, static_argnums=(0, 1))
def _steps(step, n, params, state):
  return jax.lax.fori_loop(0, n, lambda _, carry: step(*carry), (params, state))


def _bits(tree):
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


class AliasTest(parameterized.TestCase):
  """optax's test_optimization, vendored with tests/test_optax_contract.py (same
  license and adaptations)."""

  @parameterized.product(
    _OPTIMIZERS_UNDER_TEST,
    target=(_setup_parabola, _setup_rosenbrock),
    dtype=(jnp.float32, jnp.complex64),
  )
  def test_optimization(self, opt_name, opt_kwargs, target, dtype):
    if opt_name in (
      "fromage",
      "noisy_sgd",
      "sm3",
      "optimistic_gradient_descent",
      "optimistic_adam",
      "lion",
      "rprop",
      "adadelta",
      "adan",
      "polyak_sgd",
      "sign_sgd",
      "signum",
    ) and jnp.iscomplexobj(dtype):
      raise absltest.SkipTest(f"{opt_name} does not support complex parameters.")

    if opt_name in ("sign_sgd", "signum") and target is _setup_rosenbrock:
      raise absltest.SkipTest(
        f"{opt_name} requires learning rate scheduling to solve the Rosenbrockfunction"
      )

    opt = _get_opt(self, opt_name)(**opt_kwargs)
    initial_params, final_params, objective = target(dtype)

    @jax.jit
    def step(params, state):
      value, updates = jax.value_and_grad(objective)(params)
      # Complex gradients need to be conjugated before being added to parameters
      # https://gist.github.com/wdphy16/118aef6fb5f82c49790d7678cf87da29
      updates = jax.tree.map(lambda x: x.conj(), updates)
      if opt_name == "polyak_sgd":
        update_kwargs = {"value": value}
      else:
        update_kwargs = {}
      updates, state = opt.update(updates, state, params, **update_kwargs)
      params = update.apply_updates(params, updates)
      return params, state

    params = initial_params
    state = opt.init(params)

    with self.subTest("Test that tree_map_params works"):
      # A no-op change, to verify that tree map works.
      state = optax.tree.map_params(opt, lambda v: v, state)

    if jnp.iscomplexobj(dtype):  # jaxamp: refused, as torch's GradScaler does
      grads = jax.grad(objective)(params).conj()
      _assert_refuses_complex(self, opt, params, state, grads)
      return

    with self.subTest("Test that optimization works"):
      params, state = step(params, state)
      with test_utils.log_compilations() as compilation_logs:
        params, state = step(params, state)
      self.assertEmpty(compilation_logs, 'Optimizer recompiles on second call to "update".')
      # jaxamp: the other 9,998 steps in one program, not one dispatch each.
      params, state = _steps(step, 10000 - 2, params, state)

      if opt_name in ("adadelta", "adafactor") and opt_kwargs.get("learning_rate") is None:
        raise absltest.SkipTest(
          f"{opt_name} needs a non-None learning rate for numerically stable"
          " optimization in practice."
        )
      test_utils.assert_trees_all_close(params, final_params, rtol=3e-2, atol=3e-2)

    with self.subTest("Test that the optimizer doesn't recompile on 2nd call"):
      params = initial_params
      state = opt.init(params)
      params, state = step(params, state)
      with test_utils.log_compilations() as compilation_logs:
        _ = step(params, state)
      self.assertEmpty(compilation_logs, 'Optimizer recompiles on second call to "update".')


class ScaleOneIsIdentityTest(parameterized.TestCase):
  """The wrapper unscales before its branch, so the optimizer compiles as a
  computation of its own, as ``jax.jit(tx.update)`` compiles it
  (docs/optax.md)."""

  @parameterized.product(
    _OPTIMIZERS_UNDER_TEST,
    target=(_setup_parabola, _setup_rosenbrock),
  )
  def test_scale_one_returns_jitted_inner_updates_bit_for_bit(self, opt_name, opt_kwargs, target):
    # Under in_place.SMALL_BYTES: the step is the lax.cond.
    initial_params, _, objective = target(jnp.float32)
    self._assert_identity(opt_name, opt_kwargs, initial_params, objective, True, steps=20)

  @parameterized.product(_OPTIMIZERS_UNDER_TEST)
  def test_in_place_loop_returns_jitted_inner_updates_bit_for_bit(self, opt_name, opt_kwargs):
    # Over in_place.SMALL_BYTES, so the step is the loop of zero or one trip.
    rng = np.random.default_rng(0)
    initial_params = {
      "w": jnp.asarray(rng.normal(size=(512, 600)), jnp.float32),
      "b": jnp.asarray(rng.normal(size=(601,)), jnp.float32),
    }
    target = jax.tree.map(lambda x: x + 1.0, initial_params)

    def objective(params):
      return sum(
        jnp.sum((p - t) ** 2) for p, t in zip(jax.tree.leaves(params), jax.tree.leaves(target))
      )

    self.assertGreaterEqual(_nbytes(initial_params), SMALL_BYTES)
    self._assert_identity(opt_name, opt_kwargs, initial_params, objective, True, steps=3)

  def _assert_identity(self, opt_name, opt_kwargs, initial_params, objective, in_place, steps):
    plain = _unwrapped_opt(self, opt_name)(**opt_kwargs)
    wrapped = _get_opt(self, opt_name)(**opt_kwargs)
    kwargs = (lambda v: {"value": v}) if opt_name == "polyak_sgd" else (lambda v: {})
    update_plain = jax.jit(lambda g, s, p, v: plain.update(g, s, p, **kwargs(v)))
    update_wrapped = jax.jit(lambda g, s, p, v: wrapped.update(g, s, p, **kwargs(v)))
    params, state = initial_params, plain.init(initial_params)
    wrapped_state = wrapped.init(initial_params)
    with _in_place(in_place), mock.patch.object(in_place_loop, "SMALL_BYTES", SMALL_BYTES):
      big = _nbytes(params) + _nbytes(state) >= SMALL_BYTES
      value, grads = jax.value_and_grad(objective)(params)
      jaxpr = str(jax.make_jaxpr(update_wrapped)(grads, wrapped_state, params, value))
      self.assertEqual("while[" in jaxpr, in_place and big)  # the form under test
      for it in range(steps):
        value, grads = jax.value_and_grad(objective)(params)
        updates, new_state = update_plain(grads, state, params, value)
        got, got_state = update_wrapped(
          grads, wrapped_state._replace(inner_state=state), params, value
        )
        self.assertFalse(bool(got_state.found_inf), f"step {it} was skipped")
        self.assertEqual(float(got_state.loss_scale), 1.0)
        plain_bits = _bits((updates, optax.tree.unwrap_random_key_data(new_state)))
        got_bits = _bits((got, optax.tree.unwrap_random_key_data(got_state.inner_state)))
        self.assertEqual(got_bits, plain_bits, f"step {it}: updates differ")
        params, state = update.apply_updates(params, updates), new_state


def _nbytes(tree):
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


@contextlib.contextmanager
def _in_place(on: bool):
  """The in-place loop on or off, as ``JAXAMP_XLA_OFF=in_place`` turns it off."""
  saved = _xla.OFF
  _xla.OFF = saved - {"in_place"} if on else saved | {"in_place"}
  try:
    yield
  finally:
    _xla.OFF = saved
