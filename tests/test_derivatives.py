"""Derivatives through every jaxamp update equal those of the same optax code without
jaxamp (issue #30, item 4).

A jaxamp update with finite gradients computes the inner optimizer's update of the
unscaled gradients, so ``jax.grad`` and ``jax.jvp`` through it, with respect to the
params, the gradients and a hyperparameter (the learning rate, injected with
``optax.inject_hyperparams``), must be those of the plain optax update of the
unscaled gradients: at scale 1, and at power-of-two scales, where unscaling is exact.
Checked for the optax form (``tx.update`` + ``optax.apply_updates``),
``jaxamp.apply_scaled_updates``, ``GradScaler.step`` in a jitted function and
``jaxamp.accumulate_gradients``, each against plain optax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxamp

RTOL, ATOL = 1e-5, 1e-6
SHAPES = {"w": (2, 3), "b": (3,)}
FRONT_ENDS = ("optax", "apply_scaled_updates", "grad_scaler", "accumulate_gradients")
OPTIMIZERS = {
  "sgd": lambda learning_rate: optax.sgd(learning_rate),
  "momentum": lambda learning_rate: optax.sgd(learning_rate, momentum=0.9),
  "adam": lambda learning_rate: optax.adam(learning_rate),
  "adamw": lambda learning_rate: optax.adamw(learning_rate, weight_decay=0.1),
}
# One injected optimizer per kind, shared by the examples: jaxamp compiles per object.
INNER = {
  name: optax.inject_hyperparams(make)(learning_rate=0.1) for name, make in OPTIMIZERS.items()
}


def _with_lr(inner_state, lr):
  """An ``InjectHyperparamsState`` with its learning rate set to ``lr`` (traced)."""
  return inner_state._replace(hyperparams={**inner_state.hyperparams, "learning_rate": lr})


def plain_step(kind, params, grads, lr):
  """The reference: the injected optax optimizer on the unscaled gradients."""
  inner = INNER[kind]
  state = _with_lr(inner.init(params), lr)
  updates, _ = inner.update(grads, state, params)
  return optax.apply_updates(params, updates)


def jaxamp_step(front_end, kind, scale, params, grads, lr):
  """One jaxamp update of ``grads * scale`` (the scaled loss's gradients)."""
  inner = INNER[kind]
  scaled = jax.tree.map(lambda g: g * scale, grads)
  if front_end == "grad_scaler":
    scaler = jaxamp.GradScaler(init_scale=scale)
    scaler.scale(jnp.float32(1.0))
    opt = jaxamp.Optimizer(inner, params)
    opt.opt_state = _with_lr(opt.opt_state, lr)
    opt.grads = scaled
    scaler.step(opt)
    scaler.update()
    return opt.params
  if front_end == "accumulate_gradients":
    # Two micro-batches of half the gradients: the window's sum is `scaled`.
    tx = jaxamp.accumulate_gradients(jaxamp.dynamic_loss_scale(inner, init_scale=scale), 2)
    state = tx.init(params)
    state = state._replace(
      inner_state=state.inner_state._replace(
        inner_state=_with_lr(state.inner_state.inner_state, lr)
      )
    )
    half = jax.tree.map(lambda g: g * 0.5, scaled)
    for _ in range(2):
      updates, state = tx.update(half, state, params)
    return optax.apply_updates(params, updates)
  tx = jaxamp.dynamic_loss_scale(inner, init_scale=scale)
  state = tx.init(params)
  state = state._replace(inner_state=_with_lr(state.inner_state, lr))
  if front_end == "apply_scaled_updates":
    new_params, _ = jaxamp.apply_scaled_updates(tx, scaled, state, params)
    return new_params
  updates, state = tx.update(scaled, state, params)
  return optax.apply_updates(params, updates)


def _tree(rng, scale=1.0):
  return {k: jnp.asarray(scale * rng.normal(size=s), jnp.float32) for k, s in SHAPES.items()}


def _assert_trees_close(got, want, what):
  for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
    np.testing.assert_allclose(
      np.asarray(x), np.asarray(y), rtol=RTOL, atol=ATOL, err_msg=f"{what} {path}"
    )


# Reverse mode through the optax form (bare and accumulated) is in
# tests/test_derivatives_reverse.py.
REVERSE_FRONT_ENDS = ("apply_scaled_updates", "grad_scaler")


def _pulled(fn, cotangent):
  def loss(params, grads, lr):
    out = fn(params, grads, lr)
    return sum(jnp.sum(c * o) for c, o in zip(jax.tree.leaves(cotangent), jax.tree.leaves(out)))

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def check_derivatives(front_end, kind, scale, seed, *, reverse):
  rng = np.random.default_rng(seed)
  params, grads = _tree(rng), _tree(rng, 0.5)
  lr = jnp.float32(0.1)
  cotangent = _tree(rng)
  tangents = (_tree(rng), _tree(rng), jnp.float32(rng.normal()))

  def ours(params, grads, lr):
    return jaxamp_step(front_end, kind, scale, params, grads, lr)

  def theirs(params, grads, lr):
    return plain_step(kind, params, grads, lr)

  what = f"{front_end} {kind} scale={scale}"
  # The values first: the same step (the derivatives below are of this function).
  _assert_trees_close(jax.jit(ours)(params, grads, lr), theirs(params, grads, lr), what)
  if reverse:
    got = _pulled(ours, cotangent)(params, grads, lr)
    want = _pulled(theirs, cotangent)(params, grads, lr)
    names = ("d/dparams", "d/dgrads", "d/dlr")
  else:
    got = [jax.jit(lambda *p: jax.jvp(ours, p, tangents))(params, grads, lr)[1]]
    want = [jax.jit(lambda *p: jax.jvp(theirs, p, tangents))(params, grads, lr)[1]]
    names = ("jvp",)
  for name, g, w in zip(names, got, want):
    # Nonzero, or a derivative killed by the FMA guard (it was) would pass as 0 == 0.
    assert any(np.any(np.asarray(x) != 0) for x in jax.tree.leaves(w)), f"{what}: {name} is 0"
    _assert_trees_close(g, w, f"{what}: {name}")


SCALES = [1.0, 2.0**-3, 2.0**10, 2.0**16]


@pytest.mark.slow
@settings(max_examples=10, derandomize=True, deadline=None, database=None)
@given(
  front_end=st.sampled_from(FRONT_ENDS),
  kind=st.sampled_from(sorted(OPTIMIZERS)),
  scale=st.sampled_from(SCALES),
  seed=st.integers(0, 2**16),
)
def test_jvp_through_jaxamp_update_equals_plain_optax(front_end, kind, scale, seed):
  check_derivatives(front_end, kind, scale, seed, reverse=False)


@pytest.mark.slow
@settings(max_examples=8, derandomize=True, deadline=None, database=None)
@given(
  front_end=st.sampled_from(REVERSE_FRONT_ENDS),
  kind=st.sampled_from(sorted(OPTIMIZERS)),
  scale=st.sampled_from(SCALES),
  seed=st.integers(0, 2**16),
)
def test_grad_through_jaxamp_update_equals_plain_optax(front_end, kind, scale, seed):
  check_derivatives(front_end, kind, scale, seed, reverse=True)


def check_skipped_step_derivatives(front_end):
  """A skipped step (inf in the gradients) returns the params untouched: its
  derivative with respect to them is the identity, and zero for the gradients."""
  rng = np.random.default_rng(0)
  params, grads = _tree(rng), _tree(rng)
  grads = {**grads, "b": grads["b"].at[0].set(jnp.inf)}

  def loss(params, grads):
    out = jaxamp_step(front_end, "adam", 2.0**4, params, grads, jnp.float32(0.1))
    return sum(jnp.sum(o) for o in jax.tree.leaves(out))

  d_params, d_grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, grads)
  for x in jax.tree.leaves(d_params):
    np.testing.assert_array_equal(np.asarray(x), 1.0)
  for x in jax.tree.leaves(d_grads):
    assert not np.any(np.asarray(x)), "a skipped step does not depend on the gradients"


@pytest.mark.parametrize("front_end", REVERSE_FRONT_ENDS)
def test_grad_of_skipped_step_is_that_of_the_unchanged_params(front_end):
  check_skipped_step_derivatives(front_end)
