"""Long-run soak: 100,000 steps of the optax form (and 5,000 of ``GradScaler``) under
random inf/NaN, every step against an independent float64 reference of torch's rule.

The reference is torch's ``_amp_update_scale_`` written out in Python floats
(float64) with ``f32`` = NumPy's round-to-nearest cast to float32, subnormals
included::

  if found_inf: scale = f32(f64(scale) * backoff); tracker = 0
  elif tracker + 1 == interval:
    g = f32(f64(scale) * growth); scale = g if isfinite(g) else scale; tracker = 0
  else: tracker += 1

The injection schedule is drawn (seeded) while the reference runs: single
inf/NaN steps, short bursts, and rare deep bursts that last until the scale is
subnormal, so the scale swings between float32's largest values (where growth
overflows and is dropped) and its subnormals, and grows back. A backoff that
would round the scale to zero (where torch's scale stays for good) is never
injected. The factors are not powers of two (growth 1.5, backoff 0.3), so
every product is rounded.
"""

from __future__ import annotations

import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp

F32_TINY = float(np.finfo(np.float32).tiny)  # smallest normal float32
NEAR_ZERO = 1e-44  # below this no backoff is injected: f32(3e-45 * 0.3) is 0
# Injection codes -> the factor multiplying element 0 of leaf "a" / of leaf "b".
INJECT_A = np.array([1.0, np.inf, 1.0, np.nan], np.float32)
INJECT_B = np.array([1.0, 1.0, np.nan, -np.inf], np.float32)


def _f32(x: float) -> float:
  with np.errstate(over="ignore", under="ignore"):
    return float(np.float32(x))


def _schedule_and_reference(n, seed, *, init_scale, growth, backoff, interval, overflows=None):
  """Injection codes (0: clean) and torch's trajectory, step by step.

  ``overflows(step, scale)``, if given, says whether the scaled gradients of
  that step overflow by themselves (found_inf without an injection).
  """
  rng = np.random.default_rng(seed)
  codes = np.zeros(n, np.int8)
  out = {
    k: np.empty(n, t)
    for k, t in [
      ("loss_scale", np.float32),
      ("growth_tracker", np.int32),
      ("found_inf", bool),
      ("skipped_steps", np.int32),
      ("consecutive_skipped_steps", np.int32),
    ]
  }
  scale, tracker, skipped, consecutive = _f32(init_scale), 0, 0, 0
  burst, deep, rejected = 0, False, 0
  for i in range(n):
    if burst == 0 and not deep:
      u = rng.random()
      if u < 1e-4:
        deep = True  # until the scale is subnormal
      elif u < 2e-3:
        burst = int(rng.integers(2, 30))
    deep = deep and scale >= NEAR_ZERO
    inject = (deep or burst > 0 or rng.random() < 0.01) and scale >= NEAR_ZERO
    burst = max(burst - 1, 0)
    if inject:
      codes[i] = rng.integers(1, 4)
    found = inject or (overflows is not None and overflows(i, scale))
    if found:
      scale, tracker = _f32(scale * backoff), 0
    elif tracker + 1 == interval:
      grown = _f32(scale * growth)
      if math.isfinite(grown):
        scale = grown
      else:
        rejected += 1
      tracker = 0
    else:
      tracker += 1
    skipped += found
    consecutive = consecutive + 1 if found else 0
    for k, v in [
      ("loss_scale", scale),
      ("growth_tracker", tracker),
      ("found_inf", found),
      ("skipped_steps", skipped),
      ("consecutive_skipped_steps", consecutive),
    ]:
      out[k][i] = v
  out["rejected_growths"] = rejected
  return codes, out


def _assert_covers_the_range(ref) -> None:
  """The schedule took the scale to float32's top (growth dropped) and to subnormals."""
  scale = ref["loss_scale"]
  assert ref["rejected_growths"] > 100
  assert scale.max() > 1e38
  assert (scale < F32_TINY).sum() > 100 and scale.min() > 0
  assert ref["found_inf"].sum() > 1000


def _float32_arithmetic_scales(found_inf, *, init_scale, growth, backoff, interval):
  """The rule computed in float32 (not torch's float64 product): what the soak must tell apart."""
  scale, tracker, out = np.float32(init_scale), 0, np.empty(len(found_inf), np.float32)
  with np.errstate(over="ignore", under="ignore"):
    for i, found in enumerate(found_inf):
      if found:
        scale, tracker = np.float32(scale * np.float32(backoff)), 0
      elif tracker + 1 == interval:
        grown = np.float32(scale * np.float32(growth))
        scale, tracker = (grown if np.isfinite(grown) else scale), 0
      else:
        tracker += 1
      out[i] = scale
  return out


def _first_mismatch(got, want, names):
  for name in names:
    g, w = np.asarray(got[name]), np.asarray(want[name])
    if g.dtype == np.float32:
      g, w = g.view(np.uint32), w.view(np.uint32)
    bad = np.flatnonzero(g != w)
    if bad.size:
      i = bad[0]
      return f"{name} differs first at step {i}: {got[name][i]!r} != {want[name][i]!r}"
  return None


FIELDS = ("loss_scale", "growth_tracker", "found_inf", "skipped_steps", "consecutive_skipped_steps")

# -- optax form ------------------------------------------------------------------------

N_STEPS, CHUNK = 100_000, 10_000
OPTAX_FACTORS = {"init_scale": 2.0**16, "growth": 1.5, "backoff": 0.3, "interval": 4}


def _params():
  return {"a": jnp.array([0.5, -1.0, 2.0], jnp.float32), "b": jnp.ones((2, 2), jnp.float32)}


def _injected(base_a, base_b, code):
  a = base_a.at[0].multiply(jnp.asarray(INJECT_A)[code])
  b = base_b.at[0, 0].multiply(jnp.asarray(INJECT_B)[code])
  return {"a": a, "b": b}


@pytest.mark.slow
def test_optax_form_soak_100k_steps_matches_torch_rule_every_step():
  f = OPTAX_FACTORS
  codes, ref = _schedule_and_reference(
    N_STEPS,
    20260511,
    init_scale=f["init_scale"],
    growth=f["growth"],
    backoff=f["backoff"],
    interval=f["interval"],
  )
  _assert_covers_the_range(ref)
  f32_rule = _float32_arithmetic_scales(ref["found_inf"], **f)
  assert (f32_rule.view(np.uint32) != ref["loss_scale"].view(np.uint32)).any()
  rng = np.random.default_rng(7)
  base_a = rng.normal(size=(N_STEPS, 3)).astype(np.float32)
  base_b = rng.normal(size=(N_STEPS, 2, 2)).astype(np.float32)

  tx = jaxamp.dynamic_loss_scale(
    optax.sgd(1e-3, momentum=0.9),
    init_scale=f["init_scale"],
    growth_factor=f["growth"],
    backoff_factor=f["backoff"],
    growth_interval=f["interval"],
  )

  @jax.jit
  def run_chunk(params, opt_state, base_a, base_b, codes):
    def one_step(carry, xs):
      params, opt_state = carry
      grads = _injected(*xs)
      updates, new_state = tx.update(grads, opt_state, params)
      new_params = optax.apply_updates(params, updates)
      record = {k: getattr(new_state, k) for k in FIELDS}
      record["update_count"] = new_state.update_count
      # The inner state and params of a skipped step must come back unchanged.
      record["unchanged"] = jnp.all(
        jnp.array(
          [
            jnp.all(
              jax.lax.bitcast_convert_type(x, jnp.int32)
              == jax.lax.bitcast_convert_type(y, jnp.int32)
            )
            for x, y in zip(
              jax.tree.leaves((new_params, new_state.inner_state)),
              jax.tree.leaves((params, opt_state.inner_state)),
            )
          ]
        )
      )
      return (new_params, new_state), record

    return jax.lax.scan(one_step, (params, opt_state), (base_a, base_b, codes))

  params = _params()
  opt_state = tx.init(params)
  start = time.monotonic()
  chunks = []
  for lo in range(0, N_STEPS, CHUNK):
    sl = slice(lo, lo + CHUNK)
    (params, opt_state), record = run_chunk(
      params, opt_state, base_a[sl], base_b[sl], jnp.asarray(codes[sl], jnp.int32)
    )
    chunks.append(jax.device_get(record))
  got = {k: np.concatenate([c[k] for c in chunks]) for k in chunks[0]}
  seconds = time.monotonic() - start

  assert _first_mismatch(got, ref, FIELDS) is None, _first_mismatch(got, ref, FIELDS)
  assert np.array_equal(got["update_count"], np.arange(1, N_STEPS + 1))
  assert got["unchanged"][ref["found_inf"]].all(), "a skipped step changed params or state"
  print(f"optax soak: {N_STEPS} steps in {seconds:.1f} s")


# -- GradScaler -------------------------------------------------------------------------

N_SCALER = 5_000
SCALER_FACTORS = {"init_scale": 2.0**16, "growth": 1.5, "backoff": 0.3, "interval": 3}


@pytest.mark.slow
def test_grad_scaler_soak_5k_steps_matches_torch_rule_every_step():
  f = SCALER_FACTORS
  rng = np.random.default_rng(11)
  base_a = rng.normal(size=(N_SCALER, 3)).astype(np.float32)
  base_b = rng.normal(size=(N_SCALER, 2, 2)).astype(np.float32)

  def overflows(step, scale):
    # The gradient of scale * sum(p * base) is f32(scale) * base, in float32.
    with np.errstate(over="ignore"):
      g = np.float32(scale) * np.concatenate([base_a[step], base_b[step].ravel()])
    return not np.isfinite(g).all()

  codes, ref = _schedule_and_reference(
    N_SCALER,
    424242,
    init_scale=f["init_scale"],
    growth=f["growth"],
    backoff=f["backoff"],
    interval=f["interval"],
    overflows=overflows,
  )
  natural = ref["found_inf"] & (codes == 0)
  assert natural.sum() > 10, "some overflows come from the scale itself"
  assert (ref["loss_scale"] < F32_TINY).any() and ref["loss_scale"].min() > 0

  scaler = jaxamp.GradScaler(
    init_scale=f["init_scale"],
    growth_factor=f["growth"],
    backoff_factor=f["backoff"],
    growth_interval=f["interval"],
  )
  opt = jaxamp.Optimizer(optax.sgd(1e-3, momentum=0.9), _params())

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def run(scaler, opt, base_a, base_b, codes):
    def iteration(carry, xs):
      scaler, opt = carry
      base_a, base_b, code = xs

      def loss_fn(p):
        return jnp.sum(p["a"] * base_a) + jnp.sum(p["b"] * base_b)

      opt.zero_grad()
      grads = jax.grad(lambda p: scaler.scale(loss_fn(p)))(opt.params)
      opt.grads = _injected(grads["a"], grads["b"], code)
      scaler.step(opt)
      scaler.update()
      record = {
        "loss_scale": scaler.loss_scale,
        "growth_tracker": scaler.growth_tracker,
        "skipped_steps": scaler.skipped_updates,
        "consecutive_skipped_steps": scaler.consecutive_skipped_updates,
        "update_count": scaler.update_count,
      }
      return (scaler, opt), record

    return jax.lax.scan(iteration, (scaler, opt), (base_a, base_b, codes))

  start = time.monotonic()
  (scaler, opt), record = run(scaler, opt, base_a, base_b, jnp.asarray(codes, jnp.int32))
  got = jax.device_get(record)
  seconds = time.monotonic() - start
  got["found_inf"] = np.diff(got["skipped_steps"], prepend=0) == 1
  assert _first_mismatch(got, ref, FIELDS) is None, _first_mismatch(got, ref, FIELDS)
  assert np.array_equal(got["update_count"], np.arange(1, N_SCALER + 1))
  sd = scaler.state_dict()
  assert (sd["scale"], sd["_growth_tracker"]) == (
    float(ref["loss_scale"][-1]),
    int(ref["growth_tracker"][-1]),
  )
  print(f"GradScaler soak: {N_SCALER} steps in {seconds:.1f} s")


@pytest.mark.parametrize("scale", [3e-45, 1e-40, 1.1754942e-38, 2.2e38, 3.4e38])
def test_reference_rounding_at_the_edges_agrees_with_jaxamp_update(scale):
  """The reference's f32(f64(x) * factor) and jaxamp.ops.update_loss_scale, one step
  from the float32 edges (subnormals, the largest values)."""
  s = _f32(scale)
  update = jax.jit(
    functools.partial(
      jaxamp.ops.update_loss_scale, growth_factor=1.5, backoff_factor=0.3, growth_interval=4
    )
  )
  for found, tracker in [(True, 0), (False, 3)]:
    got_scale, got_tracker = update(jnp.float32(s), jnp.int32(tracker), jnp.bool_(found))
    if found:
      want = _f32(s * 0.3)
    else:
      grown = _f32(s * 1.5)
      want = grown if math.isfinite(grown) else s
    assert np.float32(got_scale).view(np.uint32) == np.float32(want).view(np.uint32)
    assert int(got_tracker) == 0
