"""Properties the speed of jaxamp rests on, checked without timing anything.

Timings live in ``benchmarks/bench_step.py``; these tests check what makes them
possible: one trace, no copies of donated buffers, a skip that leaves params
and optimizer state alone, and ``apply_scaled_updates`` agreeing with
``tx.update`` + ``optax.apply_updates``.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import bits, make_grads, needs_workaround, normal_tree

import jaxamp

SHAPES = {"a": (64, 33), "b": (37,), "c": (8, 8, 3)}


def _params(seed=0):
  return {k: jnp.asarray(x, jnp.float32) for k, x in normal_tree(SHAPES, seed).items()}


def _normal_grads(seed, dtype=jnp.float32, bad=None):
  """N(0, 100^2) gradients; ``bad`` (inf, NaN) at b[3] when given."""
  poison = None if bad is None else ("b", 3, bad)
  return make_grads(normal_tree(SHAPES, seed), scale=100, dtype=dtype, poison=poison)


def _reference_step(tx):
  def step(grads, state, params):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def _helper_step(tx):
  return lambda grads, state, params: jaxamp.apply_scaled_updates(tx, grads, state, params)


def _scaler_fields(state):
  return state._replace(inner_state=None)


BAD = [None, None, np.inf, np.nan, None, -np.inf, None]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize(
  "inner",
  [optax.adam(1e-3), optax.sgd(0.1, momentum=0.9), optax.adamw(1e-3, weight_decay=0.1)],
  ids=["adam", "sgd_momentum", "adamw"],
)
def test_apply_scaled_updates_matches_update_then_apply_op_by_op(inner, dtype):
  tx = jaxamp.dynamic_loss_scale(inner, init_scale=2.0**10, growth_interval=3)
  ours, ref = (_params(), tx.init(_params())), (_params(), tx.init(_params()))
  with jax.disable_jit():
    for i, bad in enumerate(BAD):
      grads = _normal_grads(i, dtype, bad)
      ours = _helper_step(tx)(grads, ours[1], ours[0])
      ref = _reference_step(tx)(grads, ref[1], ref[0])
      assert bits(ours) == bits(ref), i


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_apply_scaled_updates_matches_update_then_apply_under_jit(dtype):
  # The loss-scale state and every skip are bit-identical. Params and Adam's
  # moments agree to the last bits only: XLA CPU contracts a * b + c into an
  # FMA inside a fusion, and the two programs fuse Adam's arithmetic
  # differently (tx.update runs it inside its own lax.cond).
  tx = jaxamp.dynamic_loss_scale(optax.adam(1e-3), init_scale=2.0**10, growth_interval=3)
  helper, ref = jax.jit(_helper_step(tx)), jax.jit(_reference_step(tx))
  p1 = p2 = _params()
  s1 = s2 = tx.init(p1)
  for i, bad in enumerate(BAD):
    grads = _normal_grads(i, dtype, bad)
    before = (p1, s1.inner_state)
    p1, s1 = helper(grads, s1, p1)
    p2, s2 = ref(grads, s2, p2)
    assert bits(_scaler_fields(s1)) == bits(_scaler_fields(s2)), i
    if bad is not None:
      assert bits((p1, s1.inner_state)) == bits(before), i
    for x, y in zip(jax.tree.leaves((p1, s1)), jax.tree.leaves((p2, s2))):
      np.testing.assert_allclose(
        np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=1e-5, atol=1e-8
      )
  assert helper._cache_size() == 1


def test_apply_scaled_updates_skip_keeps_params_and_state_bitwise():
  tx = jaxamp.dynamic_loss_scale(optax.adam(1e-3), init_scale=8.0)
  params = _params()
  state = tx.init(params)
  step = jax.jit(_helper_step(tx))
  params, state = step(_normal_grads(0), state, params)
  for bad in (np.inf, -np.inf, np.nan):
    new_params, new_state = step(_normal_grads(1, bad=bad), state, params)
    assert bits((new_params, new_state.inner_state)) == bits((params, state.inner_state))
    assert bool(new_state.found_inf)
    assert float(new_state.loss_scale) == float(state.loss_scale) / 2
    state = new_state


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_dynamic_loss_scale_low_precision_grads_with_float32_params_work_in_both_forms(dtype):
  tx = jaxamp.dynamic_loss_scale(optax.adam(1e-3))
  params = _params()
  for step in (_reference_step(tx), _helper_step(tx)):
    state = tx.init(params)
    new_params, state = jax.jit(step)(_normal_grads(0, dtype), state, params)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(new_params))
    new_params, state = jax.jit(step)(_normal_grads(0, dtype, bad=np.inf), state, new_params)
    assert bool(state.found_inf)


def test_apply_scaled_updates_traces_once_for_many_steps():
  tx = jaxamp.dynamic_loss_scale(optax.adam(1e-3), init_scale=4.0, growth_interval=2)
  traces = []

  def step(grads, state, params):
    traces.append(1)
    return jaxamp.apply_scaled_updates(tx, grads, state, params)

  step = jax.jit(step, donate_argnums=(1, 2))
  params = _params()
  state = tx.init(params)
  for i, bad in enumerate(BAD * 2):
    params, state = step(_normal_grads(i, bad=bad), state, params)
  assert len(traces) == 1


def _counting(inner, calls):
  """``inner`` with each trace (or eager call) of its update counted in ``calls``."""

  def update(updates, state, params=None):
    calls.append(1)
    return inner.update(updates, state, params)

  return optax.GradientTransformation(inner.init, update)


@pytest.mark.slow
@pytest.mark.parametrize("form", ["helper", "optax", "grad_scaler"])
def test_each_step_traces_the_optimizer_once(form):
  # The skipped branch reuses the types the applied branch recorded instead of
  # tracing the optimizer a second time for them (compile time), and holds no
  # tracer of the applied branch (the leak checker would fail the trace).
  calls = []
  inner = _counting(optax.adam(1e-3), calls)
  params, grads = _params(), _normal_grads(0)
  with jax.checking_leaks():
    if form == "grad_scaler":
      scaler = jaxamp.GradScaler(init_scale=4.0)
      opt = jaxamp.Optimizer(inner, params)
      loss_fn = lambda p: scaler.scale(sum(jnp.sum(x**2) for x in jax.tree.leaves(p)))
      opt.grads = jax.grad(loss_fn)(opt.params)
      scaler.step(opt)
    else:
      tx = jaxamp.dynamic_loss_scale(inner, init_scale=4.0)
      state = tx.init(params)
      if form == "helper":
        jax.jit(jaxamp.apply_scaled_updates, static_argnums=0)(tx, grads, state, params)
      else:
        jax.jit(tx.update)(grads, state, params)
  assert len(calls) == 1


def test_skipped_step_types_come_from_eval_shape_when_apply_was_not_traced():
  from jaxamp._engine import with_output_types

  def step(x):
    return x.astype(jnp.bfloat16), {"count": jnp.int32(0)}

  x = jnp.ones(3)
  apply, output_types = with_output_types(step)
  assert output_types(x) == jax.eval_shape(step, x)
  apply(x)
  assert [t.dtype for t in jax.tree.leaves(output_types(x))] == [jnp.bfloat16, jnp.int32]


def _copies_of_param_sized_buffers(hlo: str) -> list[str]:
  sizes = {f"f32[{','.join(map(str, s))}]" for s in SHAPES.values()}
  return [
    line.strip()
    for line in hlo.splitlines()
    if re.search(r"= (f32\[[0-9,]*\])\{[0-9,]*\} copy\(", line)
    and re.search(r"= (f32\[[0-9,]*\])", line).group(1) in sizes
  ]


@pytest.mark.parametrize("form", ["helper", "optax"])
def test_dynamic_loss_scale_donated_step_compiles_without_copies_of_params_or_state(form):
  # Donated in the order the step returns them: JAX pairs each donated input
  # with the first output of its shape, so (grads, state, params) -> (params,
  # state) would pair params with Adam's mu and make XLA copy everything. The
  # step computes its gradients, as a training step does: the optax form
  # writes its updates over them, and would copy gradients that are an input.
  tx = jaxamp.dynamic_loss_scale(optax.adam(1e-3))
  step = _helper_step(tx) if form == "helper" else _reference_step(tx)
  params, x = _params(), _normal_grads(0)

  def whole_step(p, s):
    loss = lambda p: s.loss_scale * sum(jnp.sum(jnp.tanh(p[k]) * x[k]) for k in SHAPES)
    return step(jax.grad(loss)(p), s, p)

  compiled = jax.jit(whole_step, donate_argnums=(0, 1)).lower(params, tx.init(params)).compile()
  assert _copies_of_param_sized_buffers(compiled.as_text()) == []


def test_copy_count_finds_no_copies_in_plain_adam_step_but_finds_crossed_ones():
  # The check above counts what it should: the same step with the donated
  # buffers paired crosswise does copy.
  tx = optax.adam(1e-3)
  step = _reference_step(tx)
  params = _params()
  donated_in_output_order = jax.jit(lambda p, s, g: step(g, s, p), donate_argnums=(0, 1))
  crosswise = jax.jit(step, donate_argnums=(1, 2))
  ok = donated_in_output_order.lower(params, tx.init(params), _normal_grads(0)).compile()
  crossed = crosswise.lower(_normal_grads(0), tx.init(params), params).compile()
  assert _copies_of_param_sized_buffers(ok.as_text()) == []
  assert len(_copies_of_param_sized_buffers(crossed.as_text())) >= len(SHAPES)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_apply_scaled_updates_allocates_no_parameter_sized_temporary(dtype):
  # XLA CPU allocates a step's temporaries afresh on every call, and a fresh
  # buffer costs page faults (about 24 ms per 100 MB here, BENCHMARKS.md).
  # The helper writes params and state in place and materialises nothing of
  # their size (same-size leaves, and leaves alone, checked without a
  # temporary); the optax form, the control, hands its updates over in one.
  shapes = [(256, 256), (256, 256), (512, 64), (1000,), (300, 200), (3,)]
  params = [jnp.ones(s) for s in shapes]
  grads = [jnp.ones(s, dtype) for s in shapes]
  param_bytes = sum(p.nbytes for p in params)
  tx = jaxamp.dynamic_loss_scale(optax.adam(1e-3))

  def temp_bytes(step):
    jitted = jax.jit(lambda p, s, g: step(g, s, p), donate_argnums=(0, 1))
    compiled = jitted.lower(params, tx.init(params), grads).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  assert temp_bytes(_helper_step(tx)) < 0.02 * param_bytes
  assert temp_bytes(_reference_step(tx)) >= param_bytes


def _mlp_loss(x):
  def loss(p):
    h = jax.nn.gelu(x @ p["w1"].astype(jnp.float16))
    return jnp.mean((h @ p["w2"].astype(jnp.float16)).astype(jnp.float32) ** 2)

  return loss


def test_apply_scaled_updates_with_disabled_scaler_is_plain_update():
  tx = jaxamp.dynamic_loss_scale(optax.sgd(0.5), enabled=False)
  params = {"w": jnp.ones(2)}
  new_params, _ = jax.jit(_helper_step(tx))({"w": jnp.array([2.0, 4.0])}, tx.init(params), params)
  assert new_params["w"].tolist() == [0.0, -1.0]


def test_apply_scaled_updates_rejects_transform_that_changes_grads_first():
  tx = optax.MultiSteps(jaxamp.dynamic_loss_scale(optax.sgd(0.1)), 2)
  params = {"w": jnp.ones(2)}
  with pytest.raises(ValueError, match="sums them before it checks them"):
    jax.jit(_helper_step(tx))({"w": jnp.ones(2)}, tx.init(params), params)


def test_apply_scaled_updates_needs_a_jaxamp_state():
  tx = optax.sgd(0.1)
  params = {"w": jnp.ones(2)}
  with pytest.raises(ValueError):
    jaxamp.apply_scaled_updates(tx, params, tx.init(params), params)


def _add_params():
  """An inner transform whose update is ``grads + params``: fused with the
  unscaling, LLVM would contract ``g * inv + p`` into one FMA."""
  return optax.GradientTransformation(
    lambda params: optax.EmptyState(),
    lambda updates, state, params: (jax.tree.map(jnp.add, updates, params), state),
  )


@pytest.mark.parametrize("inner", ["add_params", "identity"])
@pytest.mark.parametrize("form", ["helper", "optax"])
def test_dynamic_loss_scale_fused_unscaling_keeps_torchs_rounded_unscaled_grads(form, inner):
  # The unscaling runs inside the optimizer's kernels; each unscaled value must
  # still be rounded to float32 (torch materialises it) before the optimizer
  # uses it, and the updates before apply_updates adds them: f32(g * inv) + p,
  # not fma(g, inv, p). With the identity, the helper's params are
  # p + f32(g * inv), also where both roundings meet.
  tx = jaxamp.dynamic_loss_scale(
    _add_params() if inner == "add_params" else optax.identity(), init_scale=3.0
  )
  params, grads = _params(1), _normal_grads(2)
  state = tx.init(params)
  unscaled = {k: np.asarray(grads[k]) * (np.float32(1.0) / np.float32(3.0)) for k in SHAPES}
  updates = (
    {k: unscaled[k] + np.asarray(params[k]) for k in SHAPES} if inner == "add_params" else unscaled
  )
  if form == "helper":
    got, _ = jax.jit(_helper_step(tx))(grads, state, params)
    expected = {k: np.asarray(params[k]) + updates[k] for k in SHAPES}
  else:
    got, _ = jax.jit(tx.update)(grads, state, params)
    expected = updates
  for k in SHAPES:
    assert expected[k].dtype == np.float32
    assert np.asarray(got[k]).tobytes() == expected[k].tobytes(), k


@needs_workaround("layout")
@pytest.mark.parametrize("form", ["helper", "optax"])
def test_weight_gradients_reach_the_optimizer_without_a_layout_copy(form):
  # XLA CPU writes a float16 dot's weight gradient column-major; plain Adam's
  # kernels read it so, the transposition fused into them (the control). Behind
  # the step's lax.cond, its branch used to copy each weight gradient into
  # row-major in a kernel of its own (1.5-1.6x a plain step at batch 1,
  # BENCHMARKS.md, "Gradient layout").
  params = {"w1": jnp.full((384, 1536), 0.01), "w2": jnp.full((1536, 384), 0.01)}
  loss = _mlp_loss(jnp.ones((16, 384), jnp.float16))

  def layout_copies(tx, form):
    step = _helper_step(tx) if form == "helper" else _reference_step(tx)
    jitted = jax.jit(lambda p, s: step(jax.grad(loss)(p), s, p), donate_argnums=(0, 1))
    hlo = jitted.lower(params, tx.init(params)).compile().as_text()
    # A kernel that only copies its operand: the weight gradient, relaid out.
    pattern = r"ROOT %copy[.0-9]* = f32\[(384,1536|1536,384)\]\S* copy\(%param"
    return [line.strip() for line in hlo.splitlines() if re.search(pattern, line)]

  assert layout_copies(optax.adam(1e-3), "optax") == []
  assert layout_copies(jaxamp.dynamic_loss_scale(optax.adam(1e-3)), form) == []


def test_row_major_changes_no_value_and_keeps_the_tree():
  from jaxamp._xla.layout import row_major

  grads = {"w": jnp.arange(12.0).reshape(3, 4).T, "b": jnp.arange(3.0), "none": None, "s": 2.0}
  assert row_major(grads) is grads  # outside a trace: as it is
  out = jax.jit(row_major)(grads)
  assert jax.tree.structure(out) == jax.tree.structure(grads)
  for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(grads)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.slow
@needs_workaround("platform")
@pytest.mark.parametrize("front_end", ["apply_scaled_updates", "tx.update"])
def test_float16_gradients_are_unscaled_without_an_integer_guard_on_cpu(front_end):
  # On XLA CPU a float16 gradient of an applied step is rounded by its own
  # convert, so no integer XOR guards it (it cost ResNet-50's tree some 10%;
  # BENCHMARKS.md, "Per-platform leaves"); float32 gradients keep theirs.
  tx = jaxamp.dynamic_loss_scale(optax.adam(1e-3))
  step = _helper_step(tx) if front_end == "apply_scaled_updates" else _reference_step(tx)
  params = _params()

  def hlo(dtype):
    grads = _normal_grads(0, dtype)
    return jax.jit(step).lower(grads, tx.init(params), params).compile().as_text()

  assert re.search(r"= s32\[[0-9,]*\]\{[0-9,]*\} xor\(", hlo(jnp.float32))
  assert not re.search(r"= s16\[[0-9,]*\]\{[0-9,]*\} xor\(", hlo(jnp.float16))
