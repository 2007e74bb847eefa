"""Reverse mode (``jax.grad``) through the optax form's update, bare and inside
``accumulate_gradients``, equals plain optax's (issue #30, item 4): differentiated,
the step takes ``lax.cond``, not the in-place loop of zero or one trip, which
JAX cannot transpose, and a window's end is selected, not branched to (a
``lax.cond``'s branches are traced before they are differentiated).

``jax.grad(jax.jit(step))`` traces the step before it is differentiated, so it
takes the loop; the loop is differentiated as the ``lax.cond`` that computes the
same.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_derivatives import (
  OPTIMIZERS,
  SCALES,
  _assert_trees_close,
  _tree,
  check_derivatives,
  check_skipped_step_derivatives,
  jaxamp_step,
  plain_step,
)

FRONT_ENDS = ("optax", "accumulate_gradients")


@pytest.mark.slow
@settings(max_examples=8, derandomize=True, deadline=None, database=None)
@given(
  front_end=st.sampled_from(FRONT_ENDS),
  kind=st.sampled_from(sorted(OPTIMIZERS)),
  scale=st.sampled_from(SCALES),
  seed=st.integers(0, 2**16),
)
def test_grad_through_optax_form_update_equals_plain_optax(front_end, kind, scale, seed):
  check_derivatives(front_end, kind, scale, seed, reverse=True)


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_grad_of_skipped_optax_form_step_is_that_of_the_unchanged_params(front_end):
  check_skipped_step_derivatives(front_end)


@pytest.mark.parametrize("front_end", FRONT_ENDS)
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_derivatives_of_jitted_step_equal_plain_optax(front_end, kind):
  """``jax.grad(jax.jit(step))``: the jitted step is traced before it is
  differentiated."""
  rng = np.random.default_rng(0)
  params, grads, lr = _tree(rng), _tree(rng, 0.5), jnp.float32(0.1)
  cotangent, tangents = _tree(rng), (_tree(rng), _tree(rng), jnp.float32(0.5))
  ours = jax.jit(lambda p, g, lr: jaxamp_step(front_end, kind, 2.0**10, p, g, lr))

  def theirs(p, g, lr):
    return plain_step(kind, p, g, lr)

  def loss(fn):
    def pulled(*args):
      out = fn(*args)
      return sum(jnp.sum(c * o) for c, o in zip(jax.tree.leaves(cotangent), jax.tree.leaves(out)))

    return pulled

  what = f"{front_end} {kind}"
  got = jax.grad(loss(ours), argnums=(0, 1, 2))(params, grads, lr)
  want = jax.jit(jax.grad(loss(theirs), argnums=(0, 1, 2)))(params, grads, lr)
  _assert_trees_close(got, want, f"{what}: grad")
  got = jax.jvp(ours, (params, grads, lr), tangents)[1]
  want = jax.jit(lambda *p: jax.jvp(theirs, p, tangents))(params, grads, lr)[1]
  _assert_trees_close(got, want, f"{what}: jvp")
