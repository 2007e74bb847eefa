"""torch's training-loop semantics: schedules on skipped steps, clipping, accumulation.

Each test runs the same loop under live torch (CPU) and under jaxamp.
"""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import bits

import jaxamp

torch = pytest.importorskip("torch")

# Scaled-gradient coefficients per iteration: inf at iterations 2 and 3 (two
# early skips, as a float16 run that starts at 65536 sees), NaN at 7.
COEFFICIENTS = [1.0, 2.0, np.inf, np.inf, 0.5, 1.5, -1.0, np.nan, 2.0, 1.0, 0.25, 3.0]
START = np.array([1.0, -2.0, 3.0], np.float32)


def _lr_lambda(i):
  return 0.8**i


def _torch_run(coefficients=COEFFICIENTS):
  """SGD with LambdaLR under torch's GradScaler; the lr each step used, and params."""
  param = torch.nn.Parameter(torch.tensor(START))
  opt = torch.optim.SGD([param], lr=0.5)
  sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda)
  scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=3)
  lrs, params, scales = [], [], []
  for c in coefficients:
    opt.zero_grad()
    loss = (param * torch.tensor(np.float32(c))).sum()
    scaler.scale(loss).backward()
    lrs.append(opt.param_groups[0]["lr"])
    scaler.step(opt)
    scaler.update()
    sched.step()
    params.append(param.detach().numpy().copy())
    scales.append(scaler.get_scale())
  return lrs, params, scales


def _schedule(count):
  return 0.5 * jnp.power(0.8, count.astype(jnp.float32))


def _grads(c, scale):
  return {"w": jnp.full(3, np.float32(c), jnp.float32) * scale}


@pytest.mark.torch
@pytest.mark.parametrize("jit", [False, True])
def test_dynamic_loss_scale_schedule_counts_iterations_matches_torch_lambda_lr(jit):
  # torch's LambdaLR advances every iteration, skipped ones included, while
  # SGD's own step does not: with schedule_counts="iterations" jaxamp applies
  # the same learning rate at every applied step.
  t_lrs, t_params, t_scales = _torch_run()
  tx = jaxamp.dynamic_loss_scale(
    optax.inject_hyperparams(optax.sgd)(learning_rate=_schedule),
    init_scale=4.0,
    growth_interval=3,
    schedule_counts="iterations",
  )
  params = {"w": jnp.asarray(START)}
  state = tx.init(params)
  step = (
    jax.jit(jaxamp.apply_scaled_updates, static_argnums=0) if jit else jaxamp.apply_scaled_updates
  )
  for i, c in enumerate(COEFFICIENTS):
    params, state = step(tx, _grads(c, jaxamp.get_loss_scale(state)), state, params)
    scale_state = jaxamp.ops.find_loss_scale_state(state)
    assert float(scale_state.loss_scale) == t_scales[i], i
    # The logged lr, skipped steps included: the one torch's param_groups show.
    logged = float(scale_state.inner_state.hyperparams["learning_rate"])
    assert logged == pytest.approx(t_lrs[i], rel=1e-6), i
    np.testing.assert_allclose(np.asarray(params["w"]), t_params[i], rtol=1e-6, err_msg=str(i))


@pytest.mark.torch
def test_dynamic_loss_scale_logged_lr_after_a_skip_matches_torch_optax_form():
  t_lrs, _, _ = _torch_run()
  inner = optax.inject_hyperparams(optax.sgd)(learning_rate=_schedule)
  tx = jaxamp.dynamic_loss_scale(
    inner, init_scale=4.0, growth_interval=3, schedule_counts="iterations"
  )
  params = {"w": jnp.asarray(START)}
  state, step = tx.init(params), jax.jit(tx.update)
  for i, c in enumerate(COEFFICIENTS):
    _, state = step(_grads(c, state.loss_scale), state, params)
    logged = float(state.inner_state.hyperparams["learning_rate"])
    assert logged == pytest.approx(t_lrs[i], rel=1e-6), i


@pytest.mark.torch
def test_grad_scaler_logged_lr_after_a_skip_matches_torch():
  t_lrs, _, _ = _torch_run()
  scaler = jaxamp.GradScaler(init_scale=4.0, growth_interval=3)
  inner = optax.inject_hyperparams(optax.sgd)(learning_rate=_schedule)
  opt = jaxamp.Optimizer(inner, {"w": jnp.asarray(START)})
  for i, c in enumerate(COEFFICIENTS):
    opt.grads = jax.grad(lambda p, c=c: scaler.scale(jnp.sum(p["w"] * c)))(opt.params)
    scaler.step(opt)
    scaler.update()
    logged = float(opt.opt_state.hyperparams["learning_rate"])
    assert logged == pytest.approx(t_lrs[i], rel=1e-6), i


@pytest.mark.torch
def test_grad_scaler_schedule_counts_iterations_matches_torch_lambda_lr():
  _, t_params, t_scales = _torch_run()
  scaler = jaxamp.GradScaler(init_scale=4.0, growth_interval=3, schedule_counts="iterations")
  opt = jaxamp.Optimizer(optax.sgd(learning_rate=_schedule), {"w": jnp.asarray(START)})

  @jax.jit
  def iteration(scaler, opt, c):
    opt.grads = jax.grad(lambda p: scaler.scale(jnp.sum(p["w"] * c)))(opt.params)
    scaler.step(opt)
    scaler.update()
    return scaler, opt

  for i, c in enumerate(COEFFICIENTS):
    scaler, opt = iteration(scaler, opt, jnp.float32(c))
    assert scaler.get_scale() == t_scales[i], i
    np.testing.assert_allclose(np.asarray(opt.params["w"]), t_params[i], rtol=1e-6, err_msg=str(i))


@pytest.mark.torch
def test_dynamic_loss_scale_schedule_counts_applied_pauses_the_schedule():
  # The default (optax's semantics): a skipped step leaves the schedule's count,
  # so after the two skips the schedule is two steps behind torch's.
  t_lrs, _, _ = _torch_run()
  tx = jaxamp.dynamic_loss_scale(
    optax.inject_hyperparams(optax.sgd)(learning_rate=_schedule), init_scale=4.0, growth_interval=3
  )
  params = {"w": jnp.asarray(START)}
  state = tx.init(params)
  applied = []
  for c in COEFFICIENTS:
    _, state = tx.update(_grads(c, jaxamp.get_loss_scale(state)), state, params)
    if not bool(state.found_inf):
      applied.append(float(state.inner_state.hyperparams["learning_rate"]))
  torch_applied = [lr for lr, c in zip(t_lrs, COEFFICIENTS) if np.isfinite(c)]
  assert applied == pytest.approx([0.5 * 0.8**i for i in range(len(applied))], rel=1e-6)
  assert applied[2] == pytest.approx(torch_applied[2] / 0.8**2, rel=1e-6)


def _halving(count):  # LambdaLR(lambda i: 0.5 ** i) on lr=0.5: exact in float32 and float64
  return 0.5 * jnp.power(0.5, count.astype(jnp.float32))


@pytest.mark.torch
@pytest.mark.parametrize("jit", [False, True])
def test_grad_scaler_default_schedule_follows_torchs_lr_sequence(jit):
  # A port that leaves schedule_counts out: GradScaler's default is torch's
  # (the schedule counts iterations, skipped ones included).
  param = torch.nn.Parameter(torch.tensor(START))
  t_opt = torch.optim.SGD([param], lr=0.5)
  sched = torch.optim.lr_scheduler.LambdaLR(t_opt, lambda i: 0.5**i)
  t_scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=3)
  scaler = jaxamp.GradScaler(init_scale=4.0, growth_interval=3)
  opt = jaxamp.Optimizer(
    optax.inject_hyperparams(optax.sgd)(learning_rate=_halving), {"w": jnp.asarray(START)}
  )

  def iteration(scaler, opt, c):
    opt.zero_grad()
    opt.grads = jax.grad(lambda p: scaler.scale(jnp.sum(p["w"] * c)))(opt.params)
    scaler.step(opt)
    scaler.update()
    return scaler, opt

  iteration = jax.jit(iteration) if jit else iteration
  t_applied, applied, t_skipped, skipped = [], [], [], []
  for i, c in enumerate(COEFFICIENTS):
    t_opt.zero_grad()
    t_scaler.scale((param * torch.tensor(np.float32(c))).sum()).backward()
    lr, before = t_opt.param_groups[0]["lr"], t_scaler.get_scale()
    t_scaler.step(t_opt)
    t_scaler.update()
    sched.step()
    if t_scaler.get_scale() < before:
      t_skipped.append(i)
    else:
      t_applied.append(np.float32(lr))
    scaler, opt = iteration(scaler, opt, jnp.float32(c))
    if int(scaler.consecutive_skipped_updates):
      skipped.append(i)
    else:
      applied.append(np.asarray(opt.opt_state.hyperparams["learning_rate"]))
    assert scaler.get_scale() == t_scaler.get_scale(), i
    np.testing.assert_allclose(np.asarray(opt.params["w"]), param.detach().numpy(), rtol=1e-6)
  assert skipped == t_skipped == [2, 3, 7]
  assert bits(applied) == bits(t_applied)  # the lr of every applied step, bit for bit
  assert int(opt.opt_state.count) == sched.last_epoch == len(COEFFICIENTS)


@pytest.mark.torch
def test_grad_scaler_schedule_counts_applied_is_optaxs_and_leaves_torchs_curve():
  # The opt-out, and what the default protects a port from: counting applied
  # updates, the schedule runs behind torch's by the skipped steps.
  t_lrs, _, _ = _torch_run()
  scaler = jaxamp.GradScaler(init_scale=4.0, growth_interval=3, schedule_counts="applied")
  opt = jaxamp.Optimizer(
    optax.inject_hyperparams(optax.sgd)(learning_rate=_schedule), {"w": jnp.asarray(START)}
  )
  applied = []
  for c in COEFFICIENTS:
    opt.grads = jax.grad(lambda p, c=c: scaler.scale(jnp.sum(p["w"] * c)))(opt.params)
    scaler.step(opt)
    scaler.update()
    if not int(scaler.consecutive_skipped_updates):
      applied.append(float(opt.opt_state.hyperparams["learning_rate"]))
  assert applied == pytest.approx([0.5 * 0.8**i for i in range(len(applied))], rel=1e-6)
  assert applied[2] == pytest.approx(t_lrs[4] / 0.8**2, rel=1e-6)


def test_schedule_counts_defaults_are_torchs_in_grad_scaler_and_optaxs_in_the_optax_form():
  def default(front_end):
    return inspect.signature(front_end).parameters["schedule_counts"].default

  assert default(jaxamp.GradScaler) == jaxamp.GradScaler()._config.schedule_counts == "iterations"
  assert default(jaxamp.dynamic_loss_scale) == "applied"
  tx = jaxamp.dynamic_loss_scale(optax.sgd(optax.linear_schedule(1.0, 0.0, 10)), init_scale=4.0)
  state = tx.init({"w": jnp.ones(3)})
  _, state = tx.update({"w": jnp.array([1.0, jnp.inf, 1.0])}, state, {"w": jnp.ones(3)})
  assert int(state.inner_state[-1].count) == 0  # skipped: optax's schedule did not move


class _CountingSchedule:  # a stateful schedule (init, update, __call__), not a function
  def init(self):
    return jnp.zeros([], jnp.int32)

  def update(self, state, **extra_args):
    return state + 1

  def __call__(self, state, **extra_args):
    return 0.1 / (1 + state)


def test_grad_scaler_default_refuses_a_stateful_schedule_it_cannot_advance():
  tx = optax.inject_hyperparams(optax.sgd)(learning_rate=_CountingSchedule())
  scaler, opt = jaxamp.GradScaler(), jaxamp.Optimizer(tx, {"w": jnp.ones(2)})
  opt.grads = jax.grad(lambda p: scaler.scale(jnp.sum(p["w"])))(opt.params)
  with pytest.raises(TypeError, match=r"GradScaler's default\) cannot advance .*'applied'"):
    scaler.step(opt)
  assert opt.params["w"].tolist() == [1.0, 1.0]
  scaler = jaxamp.GradScaler(schedule_counts="applied")
  opt.grads = jax.grad(lambda p: scaler.scale(jnp.sum(p["w"])))(opt.params)
  scaler.step(opt)
  assert opt.params["w"].tolist() == pytest.approx([0.9, 0.9])


def test_schedule_counts_iterations_keeps_the_optimizers_own_count():
  tx = jaxamp.dynamic_loss_scale(
    optax.adam(optax.linear_schedule(1.0, 0.0, 10)), init_scale=4.0, schedule_counts="iterations"
  )
  params = {"w": jnp.ones(3)}
  state = tx.init(params)
  _, state = tx.update({"w": jnp.array([1.0, jnp.inf, 1.0])}, state, params)
  adam, schedule = state.inner_state[0], state.inner_state[-1]
  assert int(adam.count) == 0 and int(schedule.count) == 1
  with pytest.raises(ValueError, match='schedule_counts must be "applied"'):
    jaxamp.dynamic_loss_scale(optax.sgd(0.1), schedule_counts="skipped")


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.parametrize("max_norm", [0.5, 1e3])
def test_clip_grad_norm_matches_torch_clip_grad_norm(max_norm):
  rng = np.random.default_rng(0)
  arrays = [rng.standard_normal(s).astype(np.float32) for s in [(5, 7), (3,), (2, 2, 2)]]
  tensors = [torch.nn.Parameter(torch.zeros(a.shape)) for a in arrays]
  for t, a in zip(tensors, arrays):
    t.grad = torch.tensor(a)
  t_norm = torch.nn.utils.clip_grad_norm_(tensors, max_norm)
  grads = {str(i): jnp.asarray(a) for i, a in enumerate(arrays)}
  clipped, norm = jaxamp.clip_grad_norm(grads, max_norm)
  assert float(norm) == pytest.approx(float(t_norm), rel=1e-6)
  for i, t in enumerate(tensors):
    np.testing.assert_allclose(np.asarray(clipped[str(i)]), t.grad.numpy(), rtol=2e-7)
  # The coefficient is applied even when it is 1 (as torch): below max_norm the
  # gradients are multiplied by min(max_norm / (norm + 1e-6), 1) = 1 exactly.
  if max_norm > float(t_norm):
    assert all(bool(jnp.all(clipped[k] == grads[k])) for k in grads)


@pytest.mark.torch
@pytest.mark.parametrize("form", ["grad_scaler", "optax"])
def test_accumulation_with_overflow_then_more_windows_matches_torch(form):
  # torch's AMP accumulation example: loss / iters_to_accumulate, backward
  # each micro-batch, step + update + zero_grad at the end of each window. An
  # inf in window 1 skips it; the next windows start from zero and train on.
  k = 3
  coefficients = [1.0, 2.0, 0.5, 1.0, np.inf, 1.0, 2.0, -1.0, 0.5, 1.5, 1.0, 0.25]
  param = torch.nn.Parameter(torch.tensor(START))
  t_opt = torch.optim.SGD([param], lr=0.25)
  t_scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=2)
  t_params, t_scales = [], []
  for i, c in enumerate(coefficients):
    loss = (param * torch.tensor(np.float32(c))).sum() / k
    t_scaler.scale(loss).backward()
    if (i + 1) % k == 0:
      t_scaler.step(t_opt)
      t_scaler.update()
      t_opt.zero_grad()
      t_params.append(param.detach().numpy().copy())
      t_scales.append(t_scaler.get_scale())

  ours_params, ours_scales = [], []
  if form == "grad_scaler":
    scaler = jaxamp.GradScaler(init_scale=8.0, growth_interval=2)
    opt = jaxamp.Optimizer(optax.sgd(0.25), {"w": jnp.asarray(START)})
    opt.zero_grad(set_to_none=False)

    @jax.jit
    def micro_step(scaler, opt, c):
      opt.accumulate(jax.grad(lambda p: scaler.scale(jnp.sum(p["w"] * c) / k))(opt.params))
      return scaler, opt

    @jax.jit
    def window_end(scaler, opt):
      scaler.step(opt)
      scaler.update()
      opt.zero_grad(set_to_none=False)
      return scaler, opt

    for i, c in enumerate(coefficients):
      scaler, opt = micro_step(scaler, opt, jnp.float32(c))
      if (i + 1) % k == 0:
        scaler, opt = window_end(scaler, opt)
        ours_params.append(np.asarray(opt.params["w"]))
        ours_scales.append(scaler.get_scale())
  else:
    tx = jaxamp.accumulate_gradients(
      jaxamp.dynamic_loss_scale(optax.sgd(0.25), init_scale=8.0, growth_interval=2), k
    )
    params = {"w": jnp.asarray(START)}
    state = tx.init(params)
    step = jax.jit(jaxamp.apply_scaled_updates, static_argnums=0)
    for i, c in enumerate(coefficients):
      grads = jax.grad(
        lambda p, state=state, c=c: jaxamp.scale_loss(jnp.sum(p["w"] * c) / k, state)
      )(params)
      params, state = step(tx, grads, state, params)
      if (i + 1) % k == 0:
        ours_params.append(np.asarray(params["w"]))
        ours_scales.append(float(jaxamp.get_loss_scale(state)))
  assert ours_scales == t_scales
  for ours, theirs in zip(ours_params, t_params):
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.parametrize("form", ["update", "apply_scaled_updates"])
def test_dynamic_loss_scale_param_labels_several_optimizers_match_torch(form):
  # torch: two optimizers, one scaler. Each is skipped only when its own
  # gradients hold inf/NaN; the scale backs off once per iteration.
  c1 = [1.0, np.inf, 0.5, 2.0, 1.0, np.nan, 1.0, 0.5]
  c2 = [2.0, 1.0, np.inf, 1.0, np.inf, np.nan, 0.25, 1.0]
  p1 = torch.nn.Parameter(torch.tensor(START))
  p2 = torch.nn.Parameter(torch.tensor(START[:2] * 2))
  o1 = torch.optim.SGD([p1], lr=0.5, momentum=0.9)
  o2 = torch.optim.Adam([p2], lr=0.125)
  t_scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=2)
  t_params, t_scales = [], []
  for a, b in zip(c1, c2):
    o1.zero_grad()
    o2.zero_grad()
    loss = (p1 * np.float32(a)).sum() + (p2 * np.float32(b)).sum()
    t_scaler.scale(loss).backward()
    t_scaler.step(o1)
    t_scaler.step(o2)
    t_scaler.update()
    t_params.append((p1.detach().numpy().copy(), p2.detach().numpy().copy()))
    t_scales.append(t_scaler.get_scale())

  tx = jaxamp.dynamic_loss_scale(
    {"sgd": optax.sgd(0.5, momentum=0.9), "adam": optax.adam(0.125)},
    param_labels={"p1": "sgd", "p2": "adam"},
    init_scale=8.0,
    growth_interval=2,
  )
  params = {"p1": jnp.asarray(START), "p2": jnp.asarray(START[:2] * 2)}
  state = tx.init(params)

  @jax.jit
  def step(params, state, a, b):
    loss_fn = lambda p: jaxamp.scale_loss(jnp.sum(p["p1"] * a) + jnp.sum(p["p2"] * b), state)
    grads = jax.grad(loss_fn)(params)
    if form == "apply_scaled_updates":
      return jaxamp.apply_scaled_updates(tx, grads, state, params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  for i, (a, b) in enumerate(zip(c1, c2)):
    before = jax.tree.map(np.asarray, params)
    params, state = step(params, state, jnp.float32(a), jnp.float32(b))
    assert float(state.loss_scale) == t_scales[i], i
    for name, t_value, c in (("p1", t_params[i][0], a), ("p2", t_params[i][1], b)):
      if not np.isfinite(c):  # skipped: bit-identical
        assert np.asarray(params[name]).tobytes() == before[name].tobytes(), (i, name)
      # torch's Adam and optax's round differently in the last bits (as elsewhere: 1e-5).
      np.testing.assert_allclose(np.asarray(params[name]), t_value, rtol=1e-5, err_msg=str(i))
  assert int(state.skipped_steps) == sum(
    not (np.isfinite(a) and np.isfinite(b)) for a, b in zip(c1, c2)
  )
