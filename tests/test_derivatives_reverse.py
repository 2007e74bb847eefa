"""Reverse mode (``jax.grad``) through the optax form's update, bare and inside
``accumulate_gradients``, equals plain optax's (issue #30, item 4): differentiated,
the step takes ``lax.cond``, not the in-place loop of zero or one trip, which
JAX cannot transpose, and a window's end is selected, not branched to (a
``lax.cond``'s branches are traced before they are differentiated).

``jax.grad(jax.jit(step))`` is not covered: the jitted step is traced before it
is differentiated, so it takes the loop, and JAX raises "Reverse-mode
differentiation does not work for lax.while_loop" (docs/optax.md); differentiate
inside ``jit`` (``jax.jit(jax.grad(...))``), or turn the loop off.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_derivatives import (
  OPTIMIZERS,
  SCALES,
  check_derivatives,
  check_skipped_step_derivatives,
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
