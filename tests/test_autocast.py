"""jaxamp.autocast: torch's autocast op policy on float32 JAX code.

The torch tests build each model twice, in torch (functional, so each op is
visible) and in JAX, from the same float32 weights, and return every
intermediate the comparison names: the JAX model's intermediates come back
through ``jaxamp.autocast`` as outputs, so their dtypes are the interpreted
ones. torch runs live under ``torch.autocast("cpu", ...)`` and jaxamp under
``policy="cpu"``.
"""

from __future__ import annotations

import math

import autocast_reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import jaxamp

HALVES = {"float16": jnp.float16, "bfloat16": jnp.bfloat16}
EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7}  # the half dtypes' machine epsilon


def _torch():
  return pytest.importorskip("torch")


def _weights(shapes, seed=0):
  rng = np.random.default_rng(seed)
  return {
    k: (rng.standard_normal(s) / math.sqrt(s[-1] if len(s) > 1 else 4)).astype(np.float32)
    for k, s in shapes.items()
  }


# -- the three models, torch and JAX ------------------------------------------------------

MLP = {"w1": (16, 8), "b1": (16,), "w2": (16, 16), "b2": (16,), "w3": (4, 16), "b3": (4,)}


def mlp_torch(F, p, x, y):
  out = {}
  out["fc1"] = h = F.linear(x, p["w1"], p["b1"])
  out["relu1"] = h = F.relu(h)
  out["fc2"] = h = F.linear(h, p["w2"], p["b2"])
  out["relu2"] = h = F.relu(h)
  out["fc3"] = h = F.linear(h, p["w3"], p["b3"])
  out["loss"] = F.mse_loss(h, y)
  return out


def mlp_jax(p, x, y):
  out = {}
  out["fc1"] = h = x @ p["w1"].T + p["b1"]
  out["relu1"] = h = jax.nn.relu(h)
  out["fc2"] = h = h @ p["w2"].T + p["b2"]
  out["relu2"] = h = jax.nn.relu(h)
  out["fc3"] = h = h @ p["w3"].T + p["b3"]
  out["loss"] = jnp.mean((h - y) ** 2)
  return out


CNN = {"k": (4, 3, 3, 3), "kb": (4,), "w": (5, 4 * 3 * 3), "b": (5,)}


def cnn_torch(F, p, x, labels):
  out = {}
  out["conv"] = h = F.conv2d(x, p["k"], p["kb"])
  out["relu"] = h = F.relu(h)
  out["pool"] = h = F.max_pool2d(h, 2)
  out["fc"] = h = F.linear(h.flatten(1), p["w"], p["b"])
  out["loss"] = F.cross_entropy(h, labels)
  return out


def _cross_entropy(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def cnn_jax(p, x, labels):
  out = {}
  h = lax.conv_general_dilated(
    x, p["k"], (1, 1), "VALID", dimension_numbers=("NCHW", "OIHW", "NCHW")
  )
  out["conv"] = h = h + p["kb"][None, :, None, None]
  out["relu"] = h = jax.nn.relu(h)
  out["pool"] = h = lax.reduce_window(h, -jnp.inf, lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")
  out["fc"] = h = h.reshape(h.shape[0], -1) @ p["w"].T + p["b"]
  # torch's CPU list has cross_entropy in float32; in a jaxpr it is log_softmax's
  # primitives, which that list runs in their input dtype: the loss opts out.
  out["loss"] = jaxamp.autocast_disabled(_cross_entropy)(h, labels)
  return out


D, HEADS, T = 8, 2, 4
BLOCK = {
  "ln1_w": (D,),
  "ln1_b": (D,),
  "wqkv": (3 * D, D),
  "bqkv": (3 * D,),
  "wo": (D, D),
  "bo": (D,),
  "ln2_w": (D,),
  "ln2_b": (D,),
  "w1": (4 * D, D),
  "b1": (4 * D,),
  "w2": (D, 4 * D),
  "b2": (D,),
}


def block_torch(F, p, x, y):
  torch = _torch()
  out = {}
  out["ln1"] = h = F.layer_norm(x, (D,), p["ln1_w"], p["ln1_b"])
  out["qkv"] = qkv = F.linear(h, p["wqkv"], p["bqkv"])
  q, k, v = (t.reshape(2, T, HEADS, D // HEADS).transpose(1, 2) for t in qkv.split(D, -1))
  out["scores"] = s = q @ k.transpose(-1, -2) / math.sqrt(D // HEADS)
  out["softmax"] = a = torch.softmax(s, -1)
  out["attn"] = o = (a @ v).transpose(1, 2).reshape(2, T, D)
  out["proj"] = o = F.linear(o, p["wo"], p["bo"])
  out["res1"] = x = x + o
  out["ln2"] = h = F.layer_norm(x, (D,), p["ln2_w"], p["ln2_b"])
  out["mlp1"] = h = F.linear(h, p["w1"], p["b1"])
  out["gelu"] = h = F.gelu(h)
  out["mlp2"] = h = F.linear(h, p["w2"], p["b2"])
  out["res2"] = x = x + h
  out["loss"] = F.mse_loss(x, y)
  return out


def _layer_norm(x, w, b):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) * lax.rsqrt(var + 1e-5) * w + b


def block_jax(p, x, y):
  out = {}
  out["ln1"] = h = _layer_norm(x, p["ln1_w"], p["ln1_b"])
  out["qkv"] = qkv = h @ p["wqkv"].T + p["bqkv"]
  q, k, v = (
    t.reshape(2, T, HEADS, D // HEADS).transpose(0, 2, 1, 3) for t in jnp.split(qkv, 3, -1)
  )
  out["scores"] = s = q @ k.swapaxes(-1, -2) / math.sqrt(D // HEADS)
  out["softmax"] = a = jax.nn.softmax(s, -1)
  out["attn"] = o = (a @ v).transpose(0, 2, 1, 3).reshape(2, T, D)
  out["proj"] = o = o @ p["wo"].T + p["bo"]
  out["res1"] = x = x + o
  out["ln2"] = h = _layer_norm(x, p["ln2_w"], p["ln2_b"])
  out["mlp1"] = h = h @ p["w1"].T + p["b1"]
  out["gelu"] = h = jax.nn.gelu(h, approximate=False)
  out["mlp2"] = h = h @ p["w2"].T + p["b2"]
  out["res2"] = x = x + h
  out["loss"] = jnp.mean((x - y) ** 2)
  return out


def _mlp_data(rng):
  return rng.standard_normal((6, 8)).astype(np.float32), rng.standard_normal((6, 4)).astype(
    np.float32
  )


def _cnn_data(rng):
  return rng.standard_normal((2, 3, 8, 8)).astype(np.float32), rng.integers(0, 5, 2)


def _block_data(rng):
  return rng.standard_normal((2, T, D)).astype(np.float32), rng.standard_normal((2, T, D)).astype(
    np.float32
  )


def _block_weights():
  w = _weights(BLOCK, seed=2)
  for name in ("ln1_w", "ln2_w"):
    w[name] = 1.0 + 0.1 * w[name]
  return w


MODELS = {
  # name: (torch forward, JAX forward, weights, data, depth: the half roundings in a row)
  "mlp": (mlp_torch, mlp_jax, lambda: _weights(MLP), _mlp_data, 3),
  "cnn": (cnn_torch, cnn_jax, lambda: _weights(CNN, seed=1), _cnn_data, 2),
  "block": (block_torch, block_jax, _block_weights, _block_data, 6),
}


def _run_both(model, half):
  torch = _torch()
  torch_fwd, jax_fwd, weights, data, depth = MODELS[model]
  p = weights()
  x, y = data(np.random.default_rng(3))
  with torch.autocast("cpu", dtype=getattr(torch, half)):
    theirs = torch_fwd(
      torch.nn.functional,
      {k: torch.tensor(v) for k, v in p.items()},
      torch.tensor(x),
      torch.tensor(y),
    )
  ours = jaxamp.autocast(jax_fwd, HALVES[half], policy="cpu")(
    {k: jnp.asarray(v) for k, v in p.items()}, jnp.asarray(x), jnp.asarray(y)
  )
  return theirs, ours, depth


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.parametrize("half", sorted(HALVES))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_op_dtypes_match_torch_cpu_autocast(model, half):
  theirs, ours, _ = _run_both(model, half)
  assert set(ours) == set(theirs)
  torch_dtypes = {k: str(v.dtype).removeprefix("torch.") for k, v in theirs.items()}
  jax_dtypes = {k: str(v.dtype) for k, v in ours.items()}
  assert jax_dtypes == torch_dtypes
  assert str(ours["loss"].dtype) == "float32"
  assert "float32" != jax_dtypes["fc1" if model == "mlp" else "conv" if model == "cnn" else "qkv"]


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.parametrize("half", sorted(HALVES))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_outputs_match_torch_within_half_rounding(model, half):
  theirs, ours, depth = _run_both(model, half)
  # torch and XLA both compute a half matmul in float32 and round once, but sum in
  # different orders: a point may differ by an ulp of its half result, and the
  # differences add up along the chain of `depth` half roundings. The bound is
  # normwise (max |diff| / max |torch|), 2 ulps per rounding; measured: <= 1.8 ulps
  bound = 2 * depth * EPS[half]
  worst = 0.0
  for name, t in theirs.items():
    t = t.detach().float().numpy()
    diff = np.max(np.abs(np.asarray(ours[name], np.float32) - t)) / max(np.max(np.abs(t)), 1e-30)
    worst = max(worst, diff)
    assert diff <= bound, (name, diff, bound)
  print(f"{model} {half}: max normwise relative difference {worst:.3g} (bound {bound:.3g})")


# Each model's linears and convs, by their output: (their input, weight, bias)
LINEARS = {
  "mlp": {"fc1": ("x", "w1", "b1"), "fc2": ("relu1", "w2", "b2"), "fc3": ("relu2", "w3", "b3")},
  "cnn": {"conv": ("x", "k", "kb"), "fc": ("pool", "w", "b")},
  "block": {
    "qkv": ("ln1", "wqkv", "bqkv"),
    "proj": ("attn", "wo", "bo"),
    "mlp1": ("ln2", "w1", "b1"),
    "mlp2": ("gelu", "w2", "b2"),
  },
}


def _half_values(a, half):
  """``a`` rounded to ``half``, as float64 (what autocast casts a float32 input to)."""
  a = a.detach().float().numpy() if hasattr(a, "detach") else np.asarray(a, np.float32)
  return np.asarray(jnp.asarray(a).astype(HALVES[half]).astype(jnp.float32), np.float64)


def _linear_reference(inp, w, b):
  """(r, err) of a linear or conv with its bias added inside, on half values."""
  if w.ndim == 2:  # over the last axis (a conv's output flattened)
    return ref.linear(inp.reshape(-1, w.shape[1]), w, b)
  conv = _torch().nn.functional.conv2d
  r = conv(_torch().tensor(inp), _torch().tensor(w)).numpy() + b[None, :, None, None]
  mag = conv(_torch().tensor(np.abs(inp)), _torch().tensor(np.abs(w))).numpy()
  return ref.accumulated(r, mag + np.abs(b)[None, :, None, None], w[0].size)


@pytest.mark.torch
@pytest.mark.parametrize("half", sorted(HALVES))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_linear_and_conv_round_once_as_torch(model, half):
  # torch's linear, addmm and conv add the bias to the float32 accumulator and
  # round once, in whatever order their kernels sum: each output, jaxamp's and
  # torch's, on its own input, is within the round-once bound of the sum
  # (tests/autocast_reference.py). Rounding the matmul and then the bias add
  # falls outside it (below, for the MLP's first layer).
  theirs, ours, _ = _run_both(model, half)
  _, _, weights, data, _ = MODELS[model]
  p = weights()
  x = data(np.random.default_rng(3))[0]
  for name, (inp, w, b) in LINEARS[model].items():
    w, b = _half_values(p[w], half), _half_values(p[b], half)
    for who, outs in (("jaxamp", ours), ("torch", theirs)):
      r, err = _linear_reference(_half_values(x if inp == "x" else outs[inp], half), w, b)
      got = _half_values(outs[name], half).reshape(r.shape)
      ok = ref.within(got, r, err, half)
      assert ok.all(), (who, name, got[~ok][:4], r[~ok][:4])
  if model == "mlp":
    h = HALVES[half]
    twice = jnp.asarray(x).astype(h) @ jnp.asarray(p["w1"]).astype(h).T + jnp.asarray(
      p["b1"]
    ).astype(h)
    r, err = ref.linear(
      _half_values(x, half), _half_values(p["w1"], half), _half_values(p["b1"], half)
    )
    assert not ref.within(_half_values(twice, half), r, err, half).all()


@pytest.mark.slow
@pytest.mark.torch
def test_linear_gradients_round_as_torchs():
  torch = _torch()
  p0 = _weights(MLP)
  x, y = _mlp_data(np.random.default_rng(5))
  tp = {k: torch.tensor(v, requires_grad=True) for k, v in p0.items()}
  with torch.autocast("cpu", dtype=torch.float16):
    t_out = mlp_torch(torch.nn.functional, tp, torch.tensor(x), torch.tensor(y))
  (t_out["fc3"].float().sum() * 1024.0).backward()  # a scaled loss; its half cotangents are exact

  def head_sum(p):
    return jnp.sum(mlp_jax(p, x, y)["fc3"].astype(jnp.float32)) * 1024.0

  params = {k: jnp.asarray(v) for k, v in p0.items()}
  grads = jax.grad(jaxamp.autocast(head_sum, jnp.float16, policy="cpu"))(params)
  out = jaxamp.autocast(mlp_jax, jnp.float16, policy="cpu")(params, x, y)
  # the backward of a half linear: half matmuls of the half cotangent, and the
  # bias gradient summed in float32 and rounded once, as torch's. The last
  # layer's, on each one's own activations: 1024 * the batch sum of relu2,
  # rounded once, and 1024 * 6 exactly.
  for who, g, relu2 in (
    ("jaxamp", {k: np.asarray(v) for k, v in grads.items()}, out["relu2"]),
    ("torch", {k: v.grad.numpy() for k, v in tp.items()}, t_out["relu2"]),
  ):
    r, err = ref.linear(np.full((4, 6), 1024.0), _half_values(relu2, "float16").T)
    assert ref.within(g["w3"], r, err, "float16").all(), who
    np.testing.assert_array_equal(g["b3"], np.full(4, 1024.0 * len(x)), err_msg=who)
  # every gradient: five half roundings in a row (two forward, three backward),
  # each of which may round an element to the other neighbour: normwise, 2 ulps
  # per rounding
  for k in p0:
    assert grads[k].dtype == jnp.float32
    t = tp[k].grad.numpy()
    diff = np.max(np.abs(np.asarray(grads[k]) - t)) / np.max(np.abs(t))
    assert diff <= 2 * 5 * EPS["float16"], (k, diff)


# -- training: autocast + loss scaling against torch autocast + GradScaler ------------------


def _mlp_loss(p, x, y):
  return mlp_jax(p, x, y)["loss"]


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.parametrize("front_end", ["grad_scaler", "optax"])
def test_training_matches_torch_autocast_and_grad_scaler(front_end):
  torch = _torch()
  p0 = _weights(MLP)
  rng = np.random.default_rng(4)
  data = [_mlp_data(rng) for _ in range(30)]
  # 2**24: the first scaled backward passes overflow float16 and skip, as torch's;
  # growth_interval=3 makes the scale grow back into overflow again and again.
  args = {"init_scale": 2.0**24, "growth_interval": 3}

  tp = {k: torch.tensor(v, requires_grad=True) for k, v in p0.items()}
  opt = torch.optim.SGD(list(tp.values()), lr=0.05)
  scaler = torch.amp.GradScaler("cpu", **args)
  torch_scales, moved = [], 0.0
  for x, y in data:
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
      loss = mlp_torch(torch.nn.functional, tp, torch.tensor(x), torch.tensor(y))["loss"]
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    grads = [t.grad.numpy() for t in tp.values()]
    if all(np.isfinite(g).all() for g in grads):
      moved += 0.05 * max(np.max(np.abs(g)) for g in grads)  # the most a step moves a parameter
    scaler.step(opt)
    scaler.update()
    torch_scales.append(scaler.get_scale())

  loss_fn = jaxamp.autocast(_mlp_loss, jnp.float16, policy="cpu")
  params = {k: jnp.asarray(v) for k, v in p0.items()}
  scales = []
  if front_end == "grad_scaler":

    @jax.jit
    def step(scaler, opt, x, y):
      opt.grads = jax.grad(lambda p: scaler.scale(loss_fn(p, x, y)))(opt.params)
      scaler.step(opt)
      scaler.update()
      return scaler, opt

    jscaler, jopt = jaxamp.GradScaler(**args), jaxamp.Optimizer(optax.sgd(0.05), params)
    for x, y in data:
      jscaler, jopt = step(jscaler, jopt, x, y)
      scales.append(jscaler.get_scale())
    params = jopt.params
  else:
    tx = jaxamp.dynamic_loss_scale(optax.sgd(0.05), **args)

    @jax.jit
    def step(params, opt_state, x, y):
      grads = jax.grad(lambda p: jaxamp.scale_loss(loss_fn(p, x, y), opt_state))(params)
      params, opt_state = jaxamp.apply_scaled_updates(tx, grads, opt_state, params)
      return params, opt_state

    opt_state = tx.init(params)
    for x, y in data:
      params, opt_state = step(params, opt_state, x, y)
      scales.append(float(jaxamp.get_loss_scale(opt_state)))

  skipped = [b < a for a, b in zip([args["init_scale"], *torch_scales], torch_scales)]
  assert sum(skipped) >= 5, "the run must overflow and skip several times"
  assert scales == torch_scales  # the same overflows, so the same skips and scales
  worst = max(float(np.max(np.abs(np.asarray(params[k]) - tp[k].detach().numpy()))) for k in p0)
  # Each applied step's gradients are within 2 half ulps per rounding of torch's,
  # normwise (test_linear_gradients_round_as_torchs: five roundings), whichever
  # kernels torch ran, and SGD moves a parameter by lr times its gradient: the
  # parameters are at most that apart, summed over the steps (twice that, for
  # what a difference does to later steps' gradients).
  bound = 2 * (2 * 5 * EPS["float16"]) * moved
  assert worst <= bound, (worst, bound)
  print(f"{front_end}: skips {sum(skipped)}/30, params max diff {worst:.3g} (bound {bound:.3g})")


# -- nested jaxprs: dtypes and gradients against the same casts written by hand ---------------

H = jnp.float16
W = jnp.asarray(np.random.default_rng(5).standard_normal((4, 4)).astype(np.float32) / 2)
X = jnp.asarray(np.random.default_rng(6).standard_normal((3, 4)).astype(np.float32))


def _hand_dot(a, b):  # what the policy does to a matmul
  return a.astype(H) @ b.astype(H)


def _custom_exp_fn(dot):
  @jax.custom_jvp
  def f(w, x):
    return jnp.exp(dot(x, w))

  @f.defjvp
  def f_jvp(primals, tangents):
    (w, x), (dw, dx) = primals, tangents
    y = f(w, x)
    return y, y * (dot(dx, w) + dot(x, dw))

  return f


def _custom_vjp_fn():
  @jax.custom_vjp
  def f(w, x):
    return jnp.sin(x @ w)

  def fwd(w, x):
    return f(w, x), (w, x)

  def bwd(res, g):  # the true derivative: the inlined primal's autodiff must agree
    w, x = res
    d = g * jnp.cos(x @ w)
    return x.T @ d, d @ w.T

  f.defvjp(fwd, bwd)
  return f


# name: (f, the same with the policy's casts written by hand)
NESTED = {
  "jit": (
    lambda w, x: jax.jit(lambda w, x: jnp.tanh(x @ w))(w, x),
    lambda w, x: jnp.tanh(_hand_dot(x, w)),
  ),
  "relu (custom_jvp)": (
    lambda w, x: jax.nn.relu(x @ w),
    lambda w, x: jax.nn.relu(_hand_dot(x, w)),
  ),
  "custom_jvp with exp": (  # exp is on the CUDA list: the primal is inlined
    lambda w, x: _custom_exp_fn(jnp.matmul)(w, x),
    lambda w, x: jnp.exp(_hand_dot(x, w).astype(jnp.float32)),
  ),
  "custom_vjp": (  # the primal inlined, differentiated as cast
    lambda w, x: _custom_vjp_fn()(w, x),
    lambda w, x: jnp.sin(_hand_dot(x, w)),
  ),
  "scan": (
    lambda w, x: lax.scan(lambda c, xt: (jnp.tanh(c @ w + xt), None), x, x[None].repeat(3, 0))[0],
    lambda w, x: lax.scan(
      lambda c, xt: (jnp.tanh(_hand_dot(c, w) + xt).astype(jnp.float32), None),
      x,
      x[None].repeat(3, 0),
    )[0],
  ),
  "cond": (
    lambda w, x: lax.cond(x.sum() > 0, lambda x: jnp.sin(x @ w), lambda x: x * 2.0, x),
    lambda w, x: lax.cond(
      x.sum() > 0, lambda x: jnp.sin(_hand_dot(x, w)).astype(jnp.float32), lambda x: x * 2.0, x
    ),
  ),
  "remat": (
    lambda w, x: jax.checkpoint(lambda w, x: jnp.sin(x @ w))(w, x),
    lambda w, x: jax.checkpoint(lambda w, x: jnp.sin(_hand_dot(x, w)))(w, x),
  ),
  "fori_loop": (
    lambda w, x: lax.fori_loop(0, 2, lambda i, c: jnp.tanh(c @ w), x),
    lambda w, x: lax.fori_loop(0, 2, lambda i, c: jnp.tanh(_hand_dot(c, w)).astype(jnp.float32), x),
  ),
}


def _sum_f32(f):
  return lambda w, x: jnp.sum(f(w, x).astype(jnp.float32) ** 2)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(NESTED))
def test_nested_jaxprs_dtypes_and_gradients_match_hand_casts(name):
  f, hand = NESTED[name]
  ours = jaxamp.autocast(f)(W, X)
  assert ours.dtype == hand(W, X).dtype
  np.testing.assert_array_equal(np.asarray(ours, np.float32), np.asarray(hand(W, X), np.float32))
  # the squared sum in float32 outside autocast: the gradient of the cast computation
  g_ours = jax.grad(lambda w, x: _sum_f32(jaxamp.autocast(f))(w, x), argnums=(0, 1))(W, X)
  g_hand = jax.grad(_sum_f32(hand), argnums=(0, 1))(W, X)
  for a, b in zip(g_ours, g_hand):
    assert a.dtype == b.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_relu_gradient_at_zero_is_its_custom_rule():
  # jax.nn.relu's custom jvp gives 0 at 0 (a plain max would give 1/2): the rule survives
  g = jax.grad(lambda x: jaxamp.autocast(lambda x: jax.nn.relu(x @ jnp.eye(2)).sum())(x))
  np.testing.assert_array_equal(np.asarray(g(jnp.array([[0.0, 1.0]]))), [[0.0, 1.0]])


def test_while_loop_carry_keeps_its_dtype():
  def f(w, x):
    return lax.while_loop(lambda c: c[1] < 3, lambda c: (jnp.tanh(c[0] @ w), c[1] + 1), (x, 0))[0]

  hand = lax.while_loop(
    lambda c: c[1] < 3,
    lambda c: (jnp.tanh(_hand_dot(c[0], W)).astype(jnp.float32), c[1] + 1),
    (X, 0),
  )[0]
  ours = jaxamp.autocast(f)(W, X)
  assert ours.dtype == jnp.float32  # the carry arrived float32 and stays float32
  np.testing.assert_array_equal(np.asarray(ours), np.asarray(hand))


def test_autocast_disabled_runs_a_region_in_float32():
  def f(w, x):
    h = x @ w
    return h, jaxamp.autocast_disabled(lambda h: jnp.tanh(h @ w))(h)

  h, inner = jaxamp.autocast(f)(W, X)
  assert h.dtype == jnp.float16 and inner.dtype == jnp.float32
  expected = jnp.tanh(_hand_dot(X, W).astype(jnp.float32) @ W)
  np.testing.assert_array_equal(np.asarray(inner), np.asarray(expected))
  off = jaxamp.autocast(f, enabled=False)  # no enclosing autocast: f itself, in float32
  for a, b in zip(off(W, X), f(W, X)):
    assert a.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# -- compositions, the cast cache, errors ---------------------------------------------------


def _mlp_params():
  return {k: jnp.asarray(v) for k, v in _weights(MLP).items()}


@pytest.mark.slow
def test_composes_with_jit_grad_vmap():
  p = _mlp_params()
  x, y = (jnp.asarray(a) for a in _mlp_data(np.random.default_rng(7)))
  loss = jaxamp.autocast(_mlp_loss)
  eager = jax.grad(loss)(p, x, y)
  jitted = jax.jit(jax.grad(loss))(p, x, y)
  for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted)):
    assert a.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  per_example = jax.vmap(loss, in_axes=(None, 0, 0))(p, x[:, None], y[:, None])
  single = jnp.stack([loss(p, x[i : i + 1], y[i : i + 1]) for i in range(x.shape[0])])
  assert per_example.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(per_example), np.asarray(single), rtol=1e-6)
  # autocast inside vmap and vmap inside autocast agree
  inside = jaxamp.autocast(jax.vmap(_mlp_loss, in_axes=(None, 0, 0)))(p, x[:, None], y[:, None])
  np.testing.assert_allclose(np.asarray(inside), np.asarray(per_example), rtol=1e-6)


@pytest.mark.slow
def test_composes_with_flax_nnx_modules_and_nnx_jit():
  nnx = pytest.importorskip("flax.nnx")
  model = nnx.Sequential(
    nnx.Linear(4, 8, rngs=nnx.Rngs(0)), jax.nn.relu, nnx.Linear(8, 2, rngs=nnx.Rngs(1))
  )
  x = jnp.ones((3, 4))
  assert jaxamp.autocast(model)(x).dtype == jnp.float16

  @nnx.jit
  def grads(model, x):
    return nnx.grad(lambda m: jnp.mean(jaxamp.autocast(m)(x).astype(jnp.float32) ** 2))(model)

  g = nnx.state(grads(model, x), nnx.Param)
  assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(g))
  assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))


def _converts(jaxpr, dtype):
  return sum(
    1
    for e in jaxpr.eqns
    if e.primitive.name == "convert_element_type" and e.params["new_dtype"] == dtype
  )


def test_a_weight_used_twice_is_cast_once():
  def f(w, x):
    return jnp.tanh(x @ w) @ w + x @ w.T  # w, its transpose and x: three float16 casts

  jaxpr = jax.make_jaxpr(jaxamp.autocast(f))(W, X).jaxpr
  assert _converts(jaxpr, jnp.float16) == 2 + 1  # w, x, and w.T (a different value)
  hand = jax.make_jaxpr(lambda w, x: jnp.tanh(_hand_dot(x, w)) @ w.astype(H) + _hand_dot(x, w.T))(
    W, X
  )
  assert _converts(jaxpr, jnp.float16) <= _converts(hand.jaxpr, jnp.float16)


def test_bad_arguments_are_refused_with_the_fix_on_the_first_line():
  with pytest.raises(ValueError, match=r"^autocast: dtype must be float16 or bfloat16, got"):
    jaxamp.autocast(_mlp_loss, jnp.float32)
  with pytest.raises(ValueError, match="dtype must be float16 or bfloat16"):
    jaxamp.autocast(_mlp_loss, jnp.int32)
  with pytest.raises(ValueError, match=r"^autocast: unknown policy 'tpu'"):
    jaxamp.autocast(_mlp_loss, policy="tpu")
  with pytest.raises(TypeError, match=r"^autocast: fn must be callable, got Array"):
    jaxamp.autocast(_mlp_loss(_mlp_params(), X[:, :8].repeat(2, 1), jnp.zeros((3, 4))))
  with pytest.raises(
    TypeError, match=r"^autocast: '<lambda>' returned a str, not a pytree of arrays"
  ):
    jaxamp.autocast(lambda x: "done")(X)


def test_unknown_primitives_run_in_their_input_dtypes():
  # sort and cumsum's neighbours: not on any list (CPU policy), they keep float16
  out = jaxamp.autocast(lambda w, x: jnp.sort(jnp.abs(x @ w), -1), policy="cpu")(W, X)
  assert out.dtype == jnp.float16
  # a float16 value into a bit-level primitive runs as the original jaxpr had it
  bits = jaxamp.autocast(lambda w, x: lax.bitcast_convert_type(x @ w, jnp.int32))(W, X)
  np.testing.assert_array_equal(
    np.asarray(bits),
    np.asarray(lax.bitcast_convert_type(_hand_dot(X, W).astype(jnp.float32), jnp.int32)),
  )


@pytest.mark.slow
def test_cuda_policy_keeps_torch_cuda_float32_ops_in_float32():
  # torch's documented CUDA lists: linear in float16; layer_norm, softmax,
  # mse_loss in float32; gelu (on no list) in its input's float16
  p = {k: jnp.asarray(v) for k, v in _block_weights().items()}
  x, y = (jnp.asarray(a) for a in _block_data(np.random.default_rng(8)))
  out = jaxamp.autocast(block_jax, jnp.float16)(p, x, y)
  dtypes = {k: str(v.dtype) for k, v in out.items()}
  assert dtypes == {
    "ln1": "float32", "qkv": "float16", "scores": "float16", "softmax": "float32",
    "attn": "float16", "proj": "float16", "res1": "float32", "ln2": "float32",
    "mlp1": "float16", "gelu": "float16", "mlp2": "float16", "res2": "float32", "loss": "float32",
  }  # fmt: skip


@pytest.mark.slow
def test_composes_with_a_linen_apply():
  nn = pytest.importorskip("flax.linen")
  net = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(2)])
  variables = net.init(jax.random.key(0), jnp.ones((1, 4)))
  out = jaxamp.autocast(net.apply)(variables, jnp.ones((3, 4)))
  assert out.dtype == jnp.float16
  g = jax.grad(
    lambda v: jnp.sum(jaxamp.autocast(net.apply)(v, jnp.ones((3, 4))).astype(jnp.float32))
  )(variables)
  assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(g))


@pytest.mark.slow
def test_shard_map_runs_as_written_in_float32():
  mesh = jax.make_mesh((1,), ("data",))
  P = jax.sharding.PartitionSpec

  def f(w, x):
    h = x @ w
    return jax.shard_map(lambda h: jnp.tanh(h @ w), mesh=mesh, in_specs=P(), out_specs=P())(h)

  out = jaxamp.autocast(f)(W, X)
  assert out.dtype == jnp.float32  # the fallback: inputs cast back to float32
  expected = jnp.tanh(_hand_dot(X, W).astype(jnp.float32) @ W)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))
  g = jax.grad(lambda w: jaxamp.autocast(f)(w, X).sum())(W)
  assert g.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(g)))


@pytest.mark.slow
def test_nnx_module_state_updates_as_without_autocast():
  nnx = pytest.importorskip("flax.nnx")
  x = jnp.asarray(np.random.default_rng(9).standard_normal((6, 4)).astype(np.float32))
  bn = nnx.BatchNorm(4, rngs=nnx.Rngs(0))
  plain = nnx.clone(bn)
  out = jaxamp.autocast(bn)(x)
  plain(x)
  assert out.dtype == jnp.float32  # no matmul: nothing in float16
  np.testing.assert_allclose(np.asarray(bn.mean[...]), np.asarray(plain.mean[...]), rtol=1e-6)
  assert bn.mean[...].dtype == jnp.float32

  drop = nnx.Sequential(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), nnx.Dropout(0.5, rngs=nnx.Rngs(1)))
  first, second = jaxamp.autocast(drop)(x), jaxamp.autocast(drop)(x)
  assert first.dtype == jnp.float16  # torch: dropout of a float16 linear output is float16
  assert not np.array_equal(np.asarray(first), np.asarray(second))  # the RNG count advanced


# -- nested regions and type promotion, against torch live -----------------------------------


def _bits(x):
  """The float32 bit patterns of a JAX array or a torch tensor (halves convert exactly)."""
  if not isinstance(x, (jax.Array, np.ndarray)):
    x = x.float().numpy()
  return np.asarray(x, np.float32).view(np.uint32)


def _nested_torch(x, w):
  torch = _torch()
  out = {}
  with torch.autocast("cpu", dtype=torch.float16):
    out["outer"] = a = x @ w
    with torch.autocast("cpu", dtype=torch.bfloat16):
      out["inner"] = x @ w
      out["inner_of_outer"] = a @ w
      out["inner_exp"] = a.exp()
      out["inner_mixed"] = a + out["inner"]
      with torch.autocast("cpu", enabled=False):
        out["off"] = x @ w
        out["off_mixed"] = a + x
        out["off_half"] = a * 2.0
        with torch.autocast("cpu", dtype=torch.bfloat16):
          out["reenabled"] = x @ w
    with torch.autocast("cpu", enabled=False):
      h = a.float()
      with torch.autocast("cpu", dtype=torch.bfloat16):
        out["in_disabled"] = h @ w
        out["in_disabled_softmax"] = torch.softmax(h, -1)
      out["disabled"] = h @ w
      out["disabled_of_inner"] = torch.softmax(out["in_disabled"], -1)  # autocast off: bf16
    out["after"] = x @ w
  return out


def _nested_jax(x, w):
  out = {}
  out["outer"] = a = x @ w

  def inner(x, w, a):
    b = x @ w

    def off(x, w, a):
      reenabled = jaxamp.autocast(lambda x, w: x @ w, jnp.bfloat16, policy="cpu")(x, w)
      return {"off": x @ w, "off_mixed": a + x, "off_half": a * 2.0, "reenabled": reenabled}

    return {
      "inner": b,
      "inner_of_outer": a @ w,
      "inner_exp": jnp.exp(a),
      "inner_mixed": a + b,
      **jaxamp.autocast(off, enabled=False)(x, w, a),
    }

  out.update(jaxamp.autocast(inner, jnp.bfloat16, policy="cpu")(x, w, a))

  def disabled(h):
    inner = jaxamp.autocast(lambda h, w: (h @ w, jax.nn.softmax(h, -1)), jnp.bfloat16, policy="cpu")
    matmul, softmax = inner(h, w)
    return {
      "in_disabled": matmul,
      "in_disabled_softmax": softmax,
      "disabled": h @ w,
      "disabled_of_inner": jax.nn.softmax(matmul, -1),
    }

  out.update(jaxamp.autocast_disabled(disabled)(a))
  out["after"] = x @ w
  return out


def _exactly_summed(rng, x_shape, w_shape):
  """x (float32, magnitudes 1/64 to 4) and w (0, +-1/2, +-1): a half matmul's
  products are x's half values scaled by powers of two, which a float32 sum of
  a few adds exactly, in any order; rounded once to the half dtype, torch's
  kernels and XLA's give the same bits whatever order they sum in."""
  x = rng.standard_normal(x_shape)
  x = np.sign(x) * np.clip(np.abs(x), 1 / 64, 4)
  return x.astype(np.float32), rng.choice([-1.0, -0.5, 0.0, 0.5, 1.0], w_shape).astype(np.float32)


@pytest.mark.torch
def test_nested_autocast_innermost_region_wins_as_torch():
  torch = _torch()
  x, w = _exactly_summed(np.random.default_rng(11), (3, 4), (4, 4))
  theirs = _nested_torch(torch.tensor(x), torch.tensor(w))
  ours = jaxamp.autocast(_nested_jax, jnp.float16, policy="cpu")(jnp.asarray(x), jnp.asarray(w))
  assert {k: str(v.dtype) for k, v in ours.items()} == {
    k: str(v.dtype).removeprefix("torch.") for k, v in theirs.items()
  }
  for k in theirs:
    if ours[k].dtype == jnp.float32:  # float32 matmuls sum in another order than torch's
      np.testing.assert_allclose(
        np.asarray(ours[k]), theirs[k].numpy(), rtol=1e-6, atol=1e-6, err_msg=k
      )
    elif k == "disabled_of_inner":
      # a bfloat16 softmax with autocast off: JAX's rounds at each primitive (d = x
      # - max, exp(d), the sum, the quotient), torch's kernel once: relative to
      # the value, within unit roundoff times |d| + max |d| + 5
      h = theirs["in_disabled"].float().numpy()
      d = np.abs(h - h.max(-1, keepdims=True))
      t = theirs[k].float().numpy()
      bound = EPS["bfloat16"] / 2 * (d + d.max(-1, keepdims=True) + 5) * np.abs(t)
      assert (np.abs(np.asarray(ours[k], np.float32) - t) <= bound).all(), k
    elif k == "inner_exp":  # a float32 exp (XLA's, torch's kernel's), rounded once
      np.testing.assert_allclose(
        np.asarray(ours[k], np.float32), theirs[k].float().numpy(), rtol=EPS["bfloat16"]
      )
    else:  # half matmuls of exactly summed products round once: torch's bits
      np.testing.assert_array_equal(_bits(ours[k]), _bits(theirs[k]), err_msg=k)


def test_nested_autocast_of_a_jitted_autocast_function_keeps_its_policy():
  inner = jax.jit(jaxamp.autocast(lambda x, w: x @ w, jnp.bfloat16))
  assert inner(X, W).dtype == jnp.bfloat16  # traced here, outside any autocast: jit caches it
  out = jaxamp.autocast(lambda x, w: (x @ w, inner(x, w)), jnp.float16)(X, W)
  assert [o.dtype for o in out] == [jnp.float16, jnp.bfloat16]
  np.testing.assert_array_equal(
    np.asarray(out[1]), np.asarray(X.astype(jnp.bfloat16) @ W.astype(jnp.bfloat16))
  )


def test_a_jitted_function_traced_inside_an_autocast_function_is_traced_again_outside():
  # inside, its autocast call only marks a region for the enclosing interpreter;
  # jax.jit must not reuse that trace outside, where nothing would interpret it
  inner = jax.jit(lambda x, w: jaxamp.autocast(lambda x, w: x @ w, jnp.bfloat16)(x, w))
  assert jaxamp.autocast(inner, jnp.float16)(X, W).dtype == jnp.bfloat16
  assert inner(X, W).dtype == jnp.bfloat16


def test_nested_autocast_policy_is_the_inner_regions():
  # a CUDA-policy region inside a CPU-policy function: exp on torch's CUDA float32 list
  def f(w, x):
    h = x @ w
    return jnp.exp(h), jaxamp.autocast(jnp.exp)(h)

  outer, inner = jaxamp.autocast(f, policy="cpu")(W, X)
  assert (outer.dtype, inner.dtype) == (jnp.float16, jnp.float32)


def test_numpy_arrays_promote_as_tensors_not_as_scalars():
  # a NumPy array, passed in or closed over, is a dimensioned float32 tensor to
  # torch's promotion (a half times it is float32); a Python scalar is not
  y = np.ones((3, 4), np.float32)
  out = jaxamp.autocast(
    lambda w, x, y: ((x @ w) * y, (x @ w) * Y_CLOSED, (x @ w) * 2.0), policy="cpu"
  )(W, X, y)
  assert [o.dtype for o in out] == [jnp.float32, jnp.float32, jnp.float16]


Y_CLOSED = np.full((3, 4), 0.5, np.float32)


# name -> (JAX, torch) over a = x @ w (half), x (float32), m (bool), i (int32 and int64)
PROMOTIONS = {
  "half * bool mask": (lambda a, x, m, i: a * m, lambda a, x, m, i: a * m),
  "half + int": (lambda a, x, m, i: a + i, lambda a, x, m, i: a + i),
  "half - float32": (lambda a, x, m, i: a - x, lambda a, x, m, i: a - x),
  "half * python float": (lambda a, x, m, i: a * 2.5, lambda a, x, m, i: a * 2.5),
  "python float - half": (lambda a, x, m, i: 1.0 - a, lambda a, x, m, i: 1.0 - a),
  "half * 0-dim float32": (lambda a, x, m, i: a * x.sum(), lambda a, x, m, i: a * x.sum()),
  "int + 0-dim half": (lambda a, x, m, i: i + a.sum(), lambda a, x, m, i: i + a.sum()),
  "0-dim half * python float": (lambda a, x, m, i: a.sum() * 3.0, lambda a, x, m, i: a.sum() * 3.0),
  "where(mask, half, python float)": (
    lambda a, x, m, i: jnp.where(m, a, 0.5),
    lambda a, x, m, i: _torch().where(m, a, 0.5),
  ),
  "where(mask, half, int)": (
    lambda a, x, m, i: jnp.where(m, a, i),
    lambda a, x, m, i: _torch().where(m, a, i),
  ),
  "where(mask, half, float32)": (
    lambda a, x, m, i: jnp.where(m, a, x),
    lambda a, x, m, i: _torch().where(m, a, x),
  ),
  "where(mask, python float, python float)": (
    lambda a, x, m, i: jnp.where(m, 0.5, 1.5),
    lambda a, x, m, i: _torch().where(m, 0.5, 1.5),
  ),
  "int * python float": (lambda a, x, m, i: i * 2.5, lambda a, x, m, i: i * 2.5),
  "float32 * bool mask": (lambda a, x, m, i: x * m, lambda a, x, m, i: x * m),
  "maximum(half, python float)": (
    lambda a, x, m, i: jnp.maximum(a, 0.0),
    lambda a, x, m, i: a.clamp(min=0.0),
  ),
  "matmul + python float": (
    lambda a, x, m, i: x @ x.T + 2.0,
    lambda a, x, m, i: x @ x.T + 2.0,
  ),
}


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.parametrize("half", sorted(HALVES))
def test_masks_ints_and_python_scalars_promote_as_torch(half):
  torch = _torch()
  rng = np.random.default_rng(12)
  x, w = _exactly_summed(rng, (3, 4), (4, 4))
  m, i = rng.random((3, 4)) > 0.5, rng.integers(-3, 4, (3, 4)).astype(np.int32)
  fns = {k: jf for k, (jf, _) in PROMOTIONS.items()}

  def ours_fn(x, w, m, i):
    a = x @ w
    return {k: f(a, x, m, i) for k, f in fns.items()}

  ours = jaxamp.autocast(ours_fn, HALVES[half], policy="cpu")(*map(jnp.asarray, (x, w, m, i)))
  tx, tw, tm, ti = (torch.tensor(v) for v in (x, w, m, i))
  with torch.autocast("cpu", dtype=getattr(torch, half)):
    a = tx @ tw
    theirs = {k: tf(a, tx, tm, ti) for k, (_, tf) in PROMOTIONS.items()}
  for k in PROMOTIONS:
    assert str(ours[k].dtype) == str(theirs[k].dtype).removeprefix("torch."), k
    np.testing.assert_array_equal(_bits(ours[k]), _bits(theirs[k]), err_msg=k)


def test_autocast_reads_nothing_of_the_machine():
  # The values autocast computes are the same on every machine: no module of it
  # reads the CPU's features, the environment or the platform (docs/autocast.md,
  # "Fused ops: computed in float32, rounded once").
  import ast
  import pathlib

  modules = sorted((pathlib.Path(jaxamp.__file__).parent / "_autocast").glob("*.py"))
  assert len(modules) >= 5
  for path in modules:
    text = path.read_text()
    imported = set()
    for node in ast.walk(ast.parse(text)):
      if isinstance(node, ast.Import):
        imported |= {alias.name.split(".")[0] for alias in node.names}
      elif isinstance(node, ast.ImportFrom):
        imported.add((node.module or "").split(".")[0])
    assert not imported & {"os", "platform", "subprocess", "ctypes", "cpuinfo"}, path.name
    for needle in ("/proc/", "cpuinfo", "ATEN_CPU_CAPABILITY", "environ", "sys.platform"):
      assert needle not in text, (path.name, needle)
