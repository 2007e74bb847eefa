"""One ``GradScaler`` shared by two threads: every update counted, or a clear refusal.

``GradScaler``'s methods change the Python object in place (the core's arrays,
the per-optimizer stages), as torch's do. Two threads running iterations on one
scaler, each with its own ``Optimizer``, must not lose updates silently: either
every ``update()`` is counted exactly, or the second thread's call raises a
``RuntimeError`` whose first line says the scaler is being used from two
threads, and every iteration that completed (all of the other thread's) counts.
"""

from __future__ import annotations

import copy
import pickle
import re
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp

ITERATIONS = 100
TWO_THREADS = re.compile(
  r"(?i)scaler.*\b(two|another|other|multiple|several|more than one)\b.*\bthreads?\b"
)


def _loss(p):
  return jnp.sum(p["w"] ** 2)


def _iterations(scaler, opt, count, errors, start=None):
  if start is not None:
    start.wait()
  for i in range(count):
    try:
      opt.zero_grad()
      opt.grads = jax.grad(lambda p: scaler.scale(_loss(p)))(opt.params)
      scaler.step(opt)
      scaler.update()
    except Exception as error:  # noqa: BLE001 (any error is recorded; the thread stops)
      errors.append((i, error))
      return


def _scaler():
  # Power-of-two factors: the unscaled gradients do not depend on the scale.
  return jaxamp.GradScaler(init_scale=2.0**10, growth_factor=2.0, growth_interval=7)


def _optimizer():
  return jaxamp.Optimizer(optax.sgd(0.01), {"w": jnp.arange(3.0)})


def _params_after(count):
  scaler, opt = _scaler(), _optimizer()
  _iterations(scaler, opt, count, errors := [])
  assert not errors
  return np.asarray(opt.params["w"])


@pytest.mark.slow
def test_two_threads_sharing_one_grad_scaler_count_every_update_or_refuse():
  scaler = _scaler()
  opts = [_optimizer(), _optimizer()]
  errors = [[], []]
  start = threading.Barrier(2)
  interval = sys.getswitchinterval()
  sys.setswitchinterval(1e-5)  # interleave the two threads finely
  try:
    threads = [
      threading.Thread(target=_iterations, args=(scaler, opts[k], ITERATIONS, errors[k], start))
      for k in range(2)
    ]
    for thread in threads:
      thread.start()
    for thread in threads:
      thread.join()
  finally:
    sys.setswitchinterval(interval)

  counted = int(scaler.update_count)
  raised = [k for k in range(2) if errors[k]]
  if not raised:
    # Sharing is safe: all 200 updates counted, as 200 in one thread would be.
    assert counted == 2 * ITERATIONS, (
      f"{counted} of {2 * ITERATIONS} updates counted: updates from two threads "
      "were lost without an error"
    )
    assert int(scaler.skipped_updates) == 0
    for opt in opts:
      np.testing.assert_array_equal(np.asarray(opt.params["w"]), _params_after(ITERATIONS))
    return
  # Refused: the thread that came second stopped at the refused call, with the
  # error; the other ran all its iterations. Every iteration that completed counted.
  assert len(raised) == 1, [(k, e) for k in range(2) for e in errors[k]]
  (second,) = raised
  ((done, error),) = errors[second]
  assert isinstance(error, RuntimeError), repr(error)
  first_line = str(error).splitlines()[0]
  assert TWO_THREADS.search(first_line), first_line
  assert counted == ITERATIONS + done, (counted, done)
  np.testing.assert_array_equal(np.asarray(opts[1 - second].params["w"]), _params_after(ITERATIONS))
  np.testing.assert_array_equal(np.asarray(opts[second].params["w"]), _params_after(done))


@pytest.mark.slow
def test_one_thread_two_optimizers_counts_every_update():
  """The control: the same 200 iterations from one thread all count."""
  scaler, opts, errors = _scaler(), [_optimizer(), _optimizer()], []
  for _ in range(ITERATIONS):
    for opt in opts:
      _iterations(scaler, opt, 1, errors)
  assert not errors
  assert int(scaler.update_count) == 2 * ITERATIONS


def test_scaler_built_in_one_thread_and_used_in_another():
  """Handing a scaler to one training thread (built in the main thread) is not sharing."""
  scaler, opt, errors = _scaler(), _optimizer(), []
  scaler.get_scale()
  worker = threading.Thread(target=_iterations, args=(scaler, opt, 20, errors))
  worker.start()
  worker.join()
  assert not errors, errors
  assert int(scaler.update_count) == 20


def _in_thread(fn):
  """Runs ``fn`` in a new thread to its end; returns the error it raised, or None."""
  errors = []

  def target():
    try:
      fn()
    except Exception as error:  # noqa: BLE001 (returned to the test)
      errors.append(error)

  thread = threading.Thread(target=target)
  thread.start()
  thread.join()
  return errors[0] if errors else None


class UserError(Exception):
  pass


def test_worker_that_raised_mid_iteration_does_not_lock_the_scaler():
  """The worker's iteration was left open (scale, unscale_, then its own code raised);
  the thread has ended, so the main thread continues, from the stages the worker left,
  as torch (step uses the found_inf its unscale_ recorded). Before, every call from any
  other thread was refused for good."""
  scaler, opt = _scaler(), _optimizer()

  def abandoned():
    opt.grads = jax.grad(lambda p: scaler.scale(_loss(p)))(opt.params)
    scaler.unscale_(opt)
    raise UserError("the user's code")

  assert isinstance(_in_thread(abandoned), UserError)
  scaler.step(opt)
  scaler.update()
  assert int(scaler.update_count) == 1
  # The next iteration, in the main thread, then from another thread, as usual.
  _iterations(scaler, opt, 1, errors := [])
  assert _in_thread(lambda: _iterations(scaler, opt, 1, errors)) is None
  assert not errors
  assert int(scaler.update_count) == 3


def test_live_thread_in_an_iteration_still_refuses_another():
  scaler, opt = _scaler(), _optimizer()
  scaler.scale(jnp.float32(1.0))  # the main thread is in an iteration
  error = _in_thread(lambda: scaler.scale(jnp.float32(1.0)))
  assert isinstance(error, RuntimeError)
  assert TWO_THREADS.search(str(error).splitlines()[0]), error
  opt.grads = {"w": jnp.ones(3)}
  scaler.step(opt)
  scaler.update()  # ends it: another thread may now run one
  errors = []
  assert _in_thread(lambda: _iterations(scaler, opt, 1, errors)) is None
  assert not errors


def test_refused_call_does_not_claim_the_scaler():
  """unscale_ before any scale() raises E6 and changes nothing, its claim included:
  another thread can still run an iteration (it was refused for good)."""
  scaler, opt = _scaler(), _optimizer()
  try:
    scaler.unscale_(opt)
  except RuntimeError as error:
    assert str(error).startswith("Attempted unscale_ but _scale is None.")
  else:
    raise AssertionError("unscale_ before scale() did not raise")
  errors = []
  _in_thread(lambda: _iterations(scaler, opt, 1, errors))
  assert not errors
  assert int(scaler.update_count) == 1


@pytest.mark.parametrize(
  "how",
  [copy.copy, copy.deepcopy, lambda s: pickle.loads(pickle.dumps(s))],
  ids=["copy", "deepcopy", "pickle"],
)
def test_copy_of_a_scaler_taken_mid_iteration_is_usable_from_another_thread(how):
  """A copy or a pickle taken after scale() starts unowned (it remembered the owner
  and refused every other thread for good)."""
  scaler, opt = _scaler(), _optimizer()
  scaler.scale(jnp.float32(1.0))
  copied, errors = how(scaler), []
  assert _in_thread(lambda: _iterations(copied, opt, 2, errors)) is None
  assert not errors
  assert int(copied.update_count) == 2
