"""The compiler workarounds (jaxamp/_xla) change no value: a training run gives
the same bits with every one of them turned off (JAXAMP_XLA_OFF=all)."""

import functools
import os
import subprocess
import sys

import pytest
from helpers import compilation_cache_env

RUN = r"""
import hashlib, jax, jax.numpy as jnp, numpy as np, optax, jaxamp

def grads_at(i, params, dtype):
  key = jax.random.PRNGKey(i)
  g = jax.tree.map(lambda p: (jax.random.normal(key, p.shape) * 300.0).astype(dtype), params)
  if i % 5 == 3:  # an overflow now and then
    g["w"] = g["w"].at[0, 0].set(jnp.inf)
  return g

digest = hashlib.sha1()
for inner in (optax.sgd(0.1, momentum=0.9), optax.adam(1e-3), optax.adamw(1e-2)):
  for dtype in (jnp.float32, jnp.float16):
    params = {"w": jnp.ones((33, 7)), "b": jnp.linspace(-1.0, 1.0, 7)}
    tx = jaxamp.dynamic_loss_scale(inner, init_scale=2.0**10, growth_interval=3)
    fused = jax.jit(jaxamp.apply_scaled_updates, static_argnums=0)
    step = jax.jit(lambda g, s, p: tx.update(g, s, p))
    states = [tx.init(params), tx.init(params)]
    ps = [params, params]
    for i in range(12):
      g = grads_at(i, params, dtype)
      ps[0], states[0] = fused(tx, g, states[0], ps[0])
      updates, states[1] = step(g, states[1], ps[1])
      ps[1] = optax.apply_updates(ps[1], updates)
    for leaf in jax.tree.leaves((ps, [s.loss_scale for s in states])):
      digest.update(np.asarray(leaf).tobytes())
print(digest.hexdigest())
"""


@functools.cache
def _run(off: str) -> str:
  """The run's digest with the workarounds ``off`` turned off; each run once per
  worker process (the baseline ``""`` is every test's reference). The runs share a
  compilation cache: a program that a workaround leaves unchanged is compiled once
  (a cache entry is keyed by the program, so a changed one compiles afresh)."""
  env = {**os.environ, **compilation_cache_env("xla_workarounds"), "JAXAMP_XLA_OFF": off}
  out = subprocess.run(
    [sys.executable, "-c", RUN], env=env, capture_output=True, text=True, check=True
  )
  return out.stdout.strip()


@pytest.mark.slow
@pytest.mark.parametrize("off", ["layout", "compile_cache", "platform", "all"])
def test_xla_workarounds_off_change_no_value(off):
  assert _run(off) == _run("")


def test_xla_workarounds_fma_guard_cannot_be_turned_off():
  # Its only plain form, lax.optimization_barrier, changed apply_scaled_updates'
  # params on XLA CPU (measured): XLA contracted the unscale into the
  # optimizer's FMAs across it. So the switch refuses it.
  env = {**os.environ, "JAXAMP_XLA_OFF": "layout,fma_guard"}
  out = subprocess.run(
    [sys.executable, "-c", "import jaxamp"], env=env, capture_output=True, text=True, check=False
  )
  assert out.returncode != 0
  assert "JAXAMP_XLA_OFF cannot turn off fma_guard" in out.stderr


def test_xla_workarounds_switch_refuses_unknown_names():
  env = {**os.environ, "JAXAMP_XLA_OFF": "layuot"}
  out = subprocess.run(
    [sys.executable, "-c", "import jaxamp"], env=env, capture_output=True, text=True, check=False
  )
  assert out.returncode != 0
  assert "JAXAMP_XLA_OFF names unknown workarounds ['layuot']" in out.stderr


@pytest.mark.slow
def test_xla_workarounds_comparison_can_fail():
  # The digest covers the params: a run one step shorter gives another one.
  shorter = RUN.replace("range(12)", "range(11)")
  env = {**os.environ, **compilation_cache_env("xla_workarounds"), "JAXAMP_XLA_OFF": ""}
  out = subprocess.run(
    [sys.executable, "-c", shorter], env=env, capture_output=True, text=True, check=True
  )
  assert out.stdout.strip() != _run("")
