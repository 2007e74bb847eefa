"""``update_loss_scale`` against the numbers torch produced (docs/torch_semantics.md §3.3, §5.x)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import bits

import jaxamp

NAN = float("nan")
INF = float("inf")


# Rows of docs/torch_semantics.md §5.7: torch's _amp_update_scale_ probed directly.
# (scale, tracker, found_inf, growth, backoff, interval, scale_after, tracker_after)
TORCH_5_7 = [
  (2.0**127, 0, 0.0, 2.0, 0.5, 1, 1.7014118346046923e38, 0),
  (3e38, 0, 0.0, 2.0, 0.5, 1, 3.0000000054977558e38, 0),
  (1.7e38, 0, 0.0, 2.0, 0.5, 1, 3.3999999521443642e38, 0),
  (1.0, 0, 0.0, 1.00000001, 0.5, 1, 1.0, 0),
  (2.0**-149, 0, 1.0, 2.0, 0.5, 10, 0.0, 0),
  (2.0**-149, 0, 1.0, 2.0, 0.75, 10, 1.401298464324817e-45, 0),
  (3 * 2.0**-149, 0, 1.0, 2.0, 0.5, 10, 2.802596928649634e-45, 0),
  (0.0, 0, 0.0, 2.0, 0.5, 1, 0.0, 0),
  (INF, 0, 0.0, 2.0, 0.5, 1, INF, 0),
  (INF, 0, 1.0, 2.0, 0.5, 1, INF, 0),
  (NAN, 0, 0.0, 2.0, 0.5, 1, NAN, 0),
  (NAN, 0, 1.0, 2.0, 0.5, 1, NAN, 0),
  (-4.0, 0, 0.0, 2.0, 0.5, 1, -8.0, 0),
  (-4.0, 0, 1.0, 2.0, 0.5, 1, -2.0, 0),
  (8.0, 0, 2.0, 2.0, 0.5, 1, 4.0, 0),
  (8.0, 0, -1.0, 2.0, 0.5, 1, 4.0, 0),
  (8.0, 0, NAN, 2.0, 0.5, 1, 4.0, 0),
  (8.0, 0, 0.5, 2.0, 0.5, 1, 4.0, 0),
  (8.0, 0, 1e-45, 2.0, 0.5, 1, 4.0, 0),
  (8.0, 5, 0.0, 2.0, 0.5, 3, 8.0, 6),
  (8.0, 2, 0.0, 2.0, 0.5, 3, 16.0, 0),
  (8.0, 0, 0.0, 2.0, 0.5, 0, 8.0, 1),
  (8.0, -1, 0.0, 2.0, 0.5, 0, 16.0, 0),
  (8.0, 0, 0.0, 2.0, 0.5, -3, 8.0, 1),
  (8.0, 2147483647, 0.0, 2.0, 0.5, 2000, 8.0, -2147483648),
  (8.0, 2147483647, 0.0, 2.0, 0.5, -(2**31), 16.0, 0),
  (8.0, 0, 0.0, 2.0, 0.5, 2**32 + 1, 8.0, 1),
  (8.0, 0, 1.0, 2.0, 1e39, 1, INF, 0),
  (8.0, 0, 0.0, 1e39, 0.5, 1, 8.0, 0),
  (3.0, 0, 1.0, 2.0, 0.1, 1, 0.30000001192092896, 0),
  (3.0, 0, 0.0, 1.1, 0.5, 1, 3.299999952316284, 0),
]


@pytest.mark.parametrize("row", TORCH_5_7, ids=[str(i) for i in range(len(TORCH_5_7))])
def test_update_loss_scale_matches_torch_kernel_probes(row):
  scale, tracker, found, growth, backoff, interval, want_scale, want_tracker = row

  @jax.jit
  def update(scale, tracker, found):
    return jaxamp.ops.update_loss_scale(
      scale,
      tracker,
      found,
      growth_factor=growth,
      backoff_factor=backoff,
      growth_interval=interval,
    )

  new_scale, new_tracker = update(jnp.float32(scale), jnp.int32(tracker), jnp.float32(found))
  if np.isnan(want_scale):
    assert np.isnan(new_scale)
  else:
    assert bits(new_scale) == bits(np.float32(want_scale))
  assert new_scale.dtype == jnp.float32 and new_tracker.dtype == jnp.int32
  assert int(new_tracker) == want_tracker


def _trajectory(init, growth, backoff, interval, flags):
  scale, tracker = jnp.float32(init), jnp.int32(0)
  update = jax.jit(
    lambda s, t, f: jaxamp.ops.update_loss_scale(
      s, t, f, growth_factor=growth, backoff_factor=backoff, growth_interval=interval
    )
  )
  scales, trackers = [], []
  for flag in flags:
    scale, tracker = update(scale, tracker, jnp.bool_(flag))
    scales.append(float(scale))
    trackers.append(int(tracker))
  return scales, trackers


def test_update_loss_scale_trajectory_b_non_dyadic_factors():
  # docs/torch_semantics.md §5.2: init 3, growth 1.5, backoff 0.3, interval 3, inf at 3, 9, 10, 11.
  flags = [i in (3, 9, 10, 11) for i in range(18)]
  scales, trackers = _trajectory(3.0, 1.5, 0.3, 3, flags)
  assert scales[2] == 4.5 and scales[3] == 1.350000023841858
  assert scales[6] == 2.0250000953674316
  assert scales[9:12] == [0.6075000166893005, 0.1822500079870224, 0.05467500165104866]
  assert scales[14] == 0.08201250433921814 and scales[17] == 0.12301875650882721
  assert trackers[:4] == [1, 2, 0, 0]


def test_update_loss_scale_trajectory_c_nan_backoffs():
  # docs/torch_semantics.md §5.3: init 3, growth 1.5, backoff 0.3, interval 2, NaN x4, then clean.
  scales, _ = _trajectory(3.0, 1.5, 0.3, 2, [1, 1, 1, 1] + [0] * 8 + [1, 0, 0])
  assert scales == [
    0.8999999761581421,
    0.26999998092651367,
    0.08099999278783798,
    0.024299997836351395,
    0.024299997836351395,
    0.03644999861717224,
    0.03644999861717224,
    0.05467499792575836,
    0.05467499792575836,
    0.08201249688863754,
    0.08201249688863754,
    0.12301874160766602,
    0.036905623972415924,
    0.036905623972415924,
    0.055358435958623886,
  ]


def test_update_loss_scale_trajectory_d_growth_chain():
  # docs/torch_semantics.md §5.4: init 1, growth 1.1, backoff 0.9, interval 2, 20 clean then 3 inf.
  scales, _ = _trajectory(1.0, 1.1, 0.9, 2, [0] * 20 + [1] * 3)
  assert scales[1::2][:10] == [
    1.100000023841858,
    1.2100000381469727,
    1.3310000896453857,
    1.4641001224517822,
    1.6105101108551025,
    1.7715611457824707,
    1.9487172365188599,
    2.1435890197753906,
    2.357947826385498,
    2.593742609024048,
  ]
  assert scales[20:] == [2.3343682289123535, 2.100931406021118, 1.8908382654190063]


def test_update_loss_scale_backs_off_to_subnormals_and_zero():
  # docs/torch_semantics.md §5.9 / scenario 15: from 65536 by 0.5, the first subnormal after
  # update 143 and exactly 0.0 after update 166, then 0 forever.
  scales, _ = _trajectory(65536.0, 2.0, 0.5, 2000, [1] * 170)
  first_subnormal = next(i for i, s in enumerate(scales) if 0 < s < 2.0**-126) + 1
  assert first_subnormal == 143 and scales[142] == 5.877471754111438e-39
  assert scales.index(0.0) + 1 == 166
  assert scales[161:165] == [
    1.1210387714598537e-44,
    5.605193857299268e-45,
    2.802596928649634e-45,
    1.401298464324817e-45,
  ]
  assert scales[169] == 0.0


def test_update_loss_scale_growth_cap():
  # Scenario 12: init 2^125, growth 2, interval 1 -> capped at 2^127.
  scales, trackers = _trajectory(2.0**125, 2.0, 0.5, 1, [0] * 4)
  assert scales == [8.507059173023462e37] + [1.7014118346046923e38] * 3
  assert trackers == [0, 0, 0, 0]
  # Scenario 13: init 4e37, growth 3, interval 2.
  scales, trackers = _trajectory(4e37, 3.0, 0.5, 2, [0] * 4)
  assert scales == [3.999999973526325e37] + [1.2000000427639215e38] * 3
  assert trackers == [1, 0, 1, 0]


@pytest.mark.slow
def test_update_loss_scale_traced_hyperparameters_match_static():
  flags = jnp.array([0, 0, 1, 0, 0, 0, 1, 1, 0, 0], bool)

  def run(growth, backoff, interval):
    def body(carry, flag):
      s, t = jaxamp.ops.update_loss_scale(
        *carry,
        flag,
        growth_factor=growth,
        backoff_factor=backoff,
        growth_interval=interval,
      )
      return (s, t), s

    return jax.lax.scan(body, (jnp.float32(3.0), jnp.int32(0)), flags)[1]

  static = jax.jit(lambda: run(1.5, 0.25, 2))()
  traced = jax.jit(run)(jnp.float32(1.5), jnp.float32(0.25), jnp.int32(2))
  assert bits(static) == bits(traced)
