"""Property tests: random trees, dtypes, inf/NaN positions and hyperparameters.

Every outcome of ``dynamic_loss_scale`` (``tx.update``) and ``GradScaler`` on
random input is either a correct run of steps, checked bit for bit against an
independent NumPy reference of torch's rule written here, or an exception whose
message starts with ``jaxamp`` or is one of torch's own messages. Valid
hyperparameters must run; invalid ones must be refused at construction.

torch's rule (docs/torch_semantics.md §3): an update that finds inf/NaN in the
*scaled* gradients is skipped (params unchanged) and multiplies the scale by
``backoff_factor``; ``growth_interval`` finite updates in a row multiply it by
``growth_factor`` unless that overflows; products are ``f32(f64(scale) *
factor)``. Unscaled gradients are ``g * f32(1 / f64(scale))``, in float32 for
float16/bfloat16 and cast back.
"""

import math

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, event, given, settings

import jaxamp

LR = 0.5  # exact in every dtype: sgd's update -LR * g is exact, so no FMA can differ
DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
SHAPES = [(), (1,), (3,), (2, 2)]
FLT_MAX = float(np.finfo(np.float32).max)
TORCH_MESSAGES = (
  "The growth factor must be > 1.0.",
  "The backoff factor must be < 1.0.",
  "value cannot be converted to type float without overflow",
  "No inf checks were recorded for this optimizer.",
)

PROFILE = settings(
  max_examples=60,
  deadline=None,
  derandomize=True,
  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# --------------------------------------------------------------------------
# Strategies


@st.composite
def leaves(draw):
  """A parameter leaf: an array of a random dtype and shape, or None."""
  if draw(st.integers(0, 7)) == 0:
    return None
  dtype = draw(st.sampled_from(sorted(DTYPES)))
  shape = draw(st.sampled_from(SHAPES))
  size = int(np.prod(shape, dtype=int))
  values = draw(st.lists(st.integers(-16, 16), min_size=size, max_size=size))
  return np.asarray(np.array(values, np.float32).reshape(shape) / 4, DTYPES[dtype])


def trees():
  """Nested dicts, lists and tuples of leaves; empty containers and bare leaves too."""
  nested = st.recursive(
    leaves(),
    lambda children: st.one_of(
      st.dictionaries(st.sampled_from("abcd"), children, max_size=3),
      st.lists(children, max_size=3),
      st.lists(children, max_size=3).map(tuple),
    ),
    max_leaves=6,
  )
  top = st.dictionaries(st.sampled_from("abcde"), nested, min_size=1, max_size=4)
  return st.one_of(top, top, top, nested)


VALID = {
  "init_scale": [1.0, 3.0, 2.0**16, 1e-3, 0.1, 2.0**100],
  "growth_factor": [2.0, 1.5, 3.0, 1.0000001],
  "backoff_factor": [0.5, 0.25, 0.3, 0.9],
  "growth_interval": [1, 2, 3, 0, -1, 2000, 2**40],
}
INVALID = {
  "init_scale": [0.0, -1.0, math.nan, math.inf, 1e39, 1e-50, "2.0", None, 10**400],
  "growth_factor": [1.0, 0.5, math.nan, math.inf, "2", 2j],
  "backoff_factor": [1.0, 0.0, -0.5, math.nan, 1.5],
  "growth_interval": [2.5, True, "3"],
}


@st.composite
def hyperparameters(draw):
  """torch's four hyperparameters, with at most one drawn from the invalid pool."""
  config = {name: draw(st.sampled_from(values)) for name, values in VALID.items()}
  if draw(st.integers(0, 3)) == 0:
    name = draw(st.sampled_from(sorted(INVALID)))
    config[name] = draw(st.sampled_from(INVALID[name]))
  return config


@st.composite
def cases(draw):
  params = draw(trees())
  n_arrays = len(jax.tree.leaves(params))
  steps = []
  for _ in range(draw(st.integers(1, 4))):
    poison = {}
    if n_arrays and draw(st.integers(0, 2)) == 0:
      for index in draw(st.sets(st.integers(0, n_arrays - 1), min_size=1, max_size=2)):
        poison[index] = draw(st.sampled_from([math.inf, -math.inf, math.nan]))
    # One value per leaf, with a full float32 mantissa: g * f32(1/scale) and g / scale differ.
    value = st.floats(-8.0, 8.0, width=32, allow_subnormal=False)
    grads = [draw(value) for _ in range(n_arrays)]
    steps.append((grads, poison))
  return params, steps, draw(hyperparameters())


# --------------------------------------------------------------------------
# The NumPy reference


def is_valid(config):
  scale, growth = config["init_scale"], config["growth_factor"]
  backoff, interval = config["backoff_factor"], config["growth_interval"]
  real = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)
  if not (real(scale) and real(growth) and real(backoff)):
    return False
  if not isinstance(interval, int) or isinstance(interval, bool):
    return False
  try:
    scale = float(scale)
  except OverflowError:
    return False
  if not (math.isfinite(scale) and 0 < scale <= FLT_MAX and np.float32(scale) > 0):
    return False
  return math.isfinite(growth) and growth > 1.0 and 0.0 < backoff < 1.0


def grads_of(params, values, poison):
  """The step's scaled gradients: leaf i filled with values[i], poisoned where drawn."""
  flat, treedef = jax.tree.flatten(params)
  out = []
  for i, leaf in enumerate(flat):
    g = np.full(leaf.shape, values[i], np.float32)
    if i in poison:
      g.reshape(-1)[0] = poison[i]
    out.append(g.astype(leaf.dtype))
  return jax.tree.unflatten(treedef, out)


def reference(params, steps, config):
  """torch's iteration in NumPy: the final params, scale and growth tracker."""
  scale, tracker = np.float32(config["init_scale"]), 0
  flat, treedef = jax.tree.flatten(params)
  flat = [np.asarray(p) for p in flat]
  for values, poison in steps:
    grads = jax.tree.leaves(grads_of(params, values, poison))
    found = any(not np.all(np.isfinite(g.astype(np.float32))) for g in grads)
    if not found:
      inv = np.float32(1.0 / np.float64(scale))
      for i, (p, g) in enumerate(zip(flat, grads)):
        unscaled = (g.astype(np.float32) * inv).astype(g.dtype)
        update = (unscaled * g.dtype.type(-LR)).astype(g.dtype)
        flat[i] = (p + update).astype(p.dtype)
    if found:
      scale, tracker = np.float32(np.float64(scale) * config["backoff_factor"]), 0
    elif tracker + 1 == config["growth_interval"]:
      grown = np.float32(np.float64(scale) * config["growth_factor"])
      scale, tracker = (grown if np.isfinite(grown) else scale), 0
    else:
      tracker += 1
  return jax.tree.unflatten(treedef, flat), scale, tracker


def assert_same_bits(got, want):
  got_flat, got_def = jax.tree.flatten(got)
  want_flat, want_def = jax.tree.flatten(want)
  assert got_def == want_def
  for g, w in zip(got_flat, want_flat):
    g = np.asarray(g)
    assert g.dtype == w.dtype and g.shape == w.shape
    assert g.tobytes() == w.tobytes(), (g, w)


def allowed(error):
  text = str(error)
  return text.startswith("jaxamp") or text.startswith(TORCH_MESSAGES)


def as_jax(tree):
  return jax.tree.map(jnp.asarray, tree)


# --------------------------------------------------------------------------
# The properties


def _run_dynamic_loss_scale(params, steps, config):
  tx = jaxamp.dynamic_loss_scale(optax.sgd(LR), **config)
  params_j = as_jax(params)
  state = tx.init(params_j)
  for values, poison in steps:
    grads = as_jax(grads_of(params, values, poison))
    updates, state = tx.update(grads, state, params_j)
    params_j = optax.apply_updates(params_j, updates)
  return params_j, state.loss_scale, state.growth_tracker


def _run_grad_scaler(params, steps, config):
  scaler = jaxamp.GradScaler(**config)
  opt = jaxamp.Optimizer(optax.sgd(LR), as_jax(params))
  for values, poison in steps:
    scaler.scale(jnp.float32(1.0))
    opt.grads = as_jax(grads_of(params, values, poison))
    scaler.step(opt)
    scaler.update()
  return opt.params, scaler.loss_scale, scaler.growth_tracker


def _check(run, params, steps, config, *, no_grads_is_torch_error=False):
  try:
    got_params, got_scale, got_tracker = run(params, steps, config)
  except Exception as error:  # noqa: BLE001 - every escape is judged here
    assert allowed(error), f"{type(error).__name__}: {error}"
    event(f"refused: {type(error).__name__}")
    if is_valid(config):
      no_grads = not jax.tree.leaves(params) and no_grads_is_torch_error
      assert no_grads and str(error).startswith("No inf checks"), f"valid config refused: {error}"
    return
  assert is_valid(config), f"invalid config accepted: {config}"
  event(f"ran: {'with' if jax.tree.leaves(params) else 'no'} gradients")
  want_params, want_scale, want_tracker = reference(params, steps, config)
  assert_same_bits(got_params, want_params)
  assert np.asarray(got_scale).tobytes() == np.float32(want_scale).tobytes(), (
    float(got_scale),
    float(want_scale),
  )
  assert int(got_tracker) == want_tracker


@pytest.mark.slow
@PROFILE
@given(cases())
def test_dynamic_loss_scale_is_torch_or_refuses(case):
  params, steps, config = case
  _check(_run_dynamic_loss_scale, params, steps, config)


@pytest.mark.slow
@PROFILE
@given(cases())
def test_grad_scaler_is_torch_or_refuses(case):
  params, steps, config = case
  # torch's step raises "No inf checks were recorded for this optimizer." when
  # the optimizer has no gradients at all; so does jaxamp's.
  _check(_run_grad_scaler, params, steps, config, no_grads_is_torch_error=True)


@pytest.mark.parametrize("run", [_run_dynamic_loss_scale, _run_grad_scaler])
def test_reference_agrees_on_a_known_case(run):
  # A hand-checked run: scale 4, growth every 2 finite steps, one inf step.
  params = {"w": np.array([1.0, 2.0], np.float32), "h": np.array([1.0], ml_dtypes.bfloat16)}
  steps = [([2.0, 4.0], {}), ([2.0, 4.0], {0: math.inf}), ([2.0, 4.0], {}), ([2.0, 4.0], {})]
  config = {"init_scale": 4.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2}
  want_params, want_scale, want_tracker = reference(params, steps, config)
  assert float(want_scale) == 4.0 and want_tracker == 0  # 4 -> 2 (inf) -> 2 -> 4
  # leaves in key order: h gets 2 (poisoned in step 2), w gets 4.
  # h: 1 - .5*2/4 - .5*2/2 - .5*2/2 = -0.25; w: [1, 2] - .5*4/4 - 2 * .5*4/2 = [-1.5, -0.5]
  assert want_params["h"].astype(np.float32).tolist() == [-0.25]
  assert want_params["w"].tolist() == [-1.5, -0.5]
  got_params, got_scale, got_tracker = run(params, steps, config)
  assert_same_bits(got_params, want_params)
  assert float(got_scale) == 4.0 and int(got_tracker) == 0
