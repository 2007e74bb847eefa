"""Crash and resume: a run SIGKILLed mid-step and mid-checkpoint resumes bit for bit.

Each variant (``nnx``: ``nnx.Optimizer`` + ``flax_utils.update``; ``linen``:
``TrainState`` + ``flax_utils.apply_gradients``; ``scaler``: ``jaxamp.GradScaler``
+ ``jaxamp.Optimizer``) runs tests/crash_resume_worker.py (40 steps, float16
compute from init_scale 2**16 so the first steps overflow by themselves, plus
inf/NaN injected at fixed steps, hysteresis 2; an orbax ``CheckpointManager``
save every 5 steps) four times, in separate processes:

1. uninterrupted: the reference;
2. fresh, paused in the middle of step K (seeded), SIGKILLed by this process;
3. resumed from the last complete checkpoint, SIGKILLs itself inside orbax's
   save of step S, with every file written but not committed (renamed);
4. resumed again, to the end.

Every step a resumed run makes must equal the reference's step, bit for bit:
params, optimizer state, scale, trackers, counters and the skip decision; the
state restored must equal the reference's state at that step; and each resume
must pick the last complete checkpoint, never the half-written one.

The children share a persistent compilation cache (speed only: XLA compiles
deterministically, and the reference process compiles afresh).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import time

import pytest

HERE = pathlib.Path(__file__).resolve().parent
WORKER = HERE / "crash_resume_worker.py"
VARIANTS = ("nnx", "linen", "scaler")
STEPS, SAVE_EVERY = 40, 5  # as in the worker (checked against its logs below)
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax's temporary-directory suffix
TIMEOUT = 240
# Twelve processes of 40 steps each: a long run, outside the inner loop.
pytestmark = pytest.mark.slow


def _plan(variant: str) -> tuple[int, int]:
  """The seeded kill step K (mid-step) and the save S killed during its commit."""
  rng = random.Random(f"crash-resume-{variant}")
  kill_at = rng.randint(SAVE_EVERY + 1, 19)
  last_saved = (kill_at - 1) // SAVE_EVERY * SAVE_EVERY
  die_in_save = rng.choice(
    [s for s in range(SAVE_EVERY, STEPS, SAVE_EVERY) if s >= last_saved + 2 * SAVE_EVERY]
  )
  return kill_at, die_in_save


def _env(cache: pathlib.Path) -> dict:
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
  env.update(
    JAX_PLATFORMS="cpu",
    JAX_COMPILATION_CACHE_DIR=str(cache),
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
  )
  return env


def _read_log(path: pathlib.Path) -> list[dict]:
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class _Child:
  def __init__(self, name, workdir, variant, ckpt, env, *flags):
    self.log = workdir / f"{name}.jsonl"
    self.stderr_path = workdir / f"{name}.stderr"
    with open(self.stderr_path, "w") as err:
      self.proc = subprocess.Popen(
        [sys.executable, str(WORKER), variant, str(ckpt), str(self.log), *map(str, flags)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=err,
      )

  def wait(self) -> int:
    try:
      return self.proc.wait(TIMEOUT)
    finally:
      if self.proc.poll() is None:
        self.proc.kill()
        self.proc.wait()

  def wait_for_first_step(self) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not any(r["event"] == "step" for r in _read_log(self.log)):
      if self.proc.poll() is not None or time.monotonic() > deadline:
        return  # its own checks report what went wrong
      time.sleep(0.05)

  def kill_when_paused(self) -> int:
    deadline = time.monotonic() + TIMEOUT
    while not any(r["event"] == "paused" for r in _read_log(self.log)):
      if self.proc.poll() is not None or time.monotonic() > deadline:
        raise AssertionError(f"child never paused: {self.stderr()}")
      time.sleep(0.05)
    os.kill(self.proc.pid, signal.SIGKILL)
    return self.wait()

  def records(self) -> list[dict]:
    return _read_log(self.log)

  def stderr(self) -> str:
    return self.stderr_path.read_text()[-3000:]


def _chain(variant: str, workdir: pathlib.Path, env: dict) -> dict:
  """Runs the four processes of one variant; returns their logs and what was on disk."""
  kill_at, die_in_save = _plan(variant)
  ckpt = workdir / f"{variant}_ckpt"
  ref = _Child(f"{variant}_ref", workdir, variant, workdir / f"{variant}_ref_ckpt", env)
  ref.wait_for_first_step()  # compiled once, into the cache the other children read
  first = _Child(f"{variant}_1", workdir, variant, ckpt, env, "--pause-at", kill_at)
  rc_first = first.kill_when_paused()
  listing_after_first = sorted(p.name for p in ckpt.iterdir())
  second = _Child(f"{variant}_2", workdir, variant, ckpt, env, "--die-in-save", die_in_save)
  rc_second = second.wait()
  listing_after_second = {p.name: sorted(q.name for q in p.iterdir()) for p in ckpt.iterdir()}
  third = _Child(f"{variant}_3", workdir, variant, ckpt, env)
  rc_third = third.wait()
  rc_ref = ref.wait()
  return {
    "kill_at": kill_at,
    "die_in_save": die_in_save,
    "ref": (rc_ref, ref.records(), ref.stderr()),
    "first": (rc_first, first.records(), first.stderr()),
    "second": (rc_second, second.records(), second.stderr()),
    "third": (rc_third, third.records(), third.stderr()),
    "listing_after_first": listing_after_first,
    "listing_after_second": listing_after_second,
    "listing_final": sorted(p.name for p in ckpt.iterdir()),
  }


@pytest.fixture(scope="module")
def chains(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("crash_resume")
  env = _env(workdir / "jax_cache")
  start = time.monotonic()
  with concurrent.futures.ThreadPoolExecutor(len(VARIANTS)) as pool:
    futures = {v: pool.submit(_chain, v, workdir, env) for v in VARIANTS}
    results = {v: f.result() for v, f in futures.items()}
  results["seconds"] = time.monotonic() - start
  return results


def _steps(records: list[dict]) -> dict[int, dict]:
  return {r["step"]: r for r in records if r["event"] == "step"}


def _saved(records: list[dict]) -> list[int]:
  return [r["step"] for r in records if r["event"] == "saved"]


def _restored(records: list[dict]) -> dict:
  (restored,) = [r for r in records if r["event"] == "restored"]
  return restored


def _assert_same_steps(resumed: dict[int, dict], reference: dict[int, dict], steps):
  assert sorted(resumed) == list(steps)
  for step in steps:
    got, want = resumed[step], reference[step]
    scalars = {k: v for k, v in want.items() if k != "bits"}
    assert {k: got[k] for k in scalars} == scalars, f"step {step}"
    assert got["bits"] == want["bits"], f"step {step}: state differs from the reference"


def _assert_interesting(reference: dict[int, dict], steps) -> None:
  """The resumed stretch holds skips, backoffs, absorbed overflows and growths."""
  kinds = set()
  for step in steps:
    before, now = reference[step - 1], reference[step]
    if now["found_inf"]:
      kinds.add("backoff" if now["loss_scale"] < before["loss_scale"] else "absorbed")
    elif now["loss_scale"] > before["loss_scale"]:
      kinds.add("growth")
  assert kinds == {"backoff", "absorbed", "growth"}, (steps, kinds)


@pytest.mark.parametrize("variant", VARIANTS)
def test_resume_after_sigkill_is_bit_identical(chains, variant):
  chain = chains[variant]
  kill_at, die_in_save = chain["kill_at"], chain["die_in_save"]
  rc_ref, ref_records, ref_err = chain["ref"]
  assert rc_ref == 0, ref_err
  reference = _steps(ref_records)
  assert sorted(reference) == list(range(1, STEPS + 1))
  assert _saved(ref_records) == list(range(SAVE_EVERY, STEPS + 1, SAVE_EVERY))
  assert ref_records[-1]["event"] == "done"
  assert sum(r["found_inf"] for r in reference.values()) >= 10

  # 1. Killed by this process in the middle of step K (computed, not logged or saved).
  rc, records, err = chain["first"]
  assert rc == -signal.SIGKILL, err
  assert records[-1] == {"event": "paused", "step": kill_at}
  _assert_same_steps(_steps(records), reference, range(1, kill_at))
  last_complete = max(_saved(records))
  assert last_complete == (kill_at - 1) // SAVE_EVERY * SAVE_EVERY

  # 2. Resumed from the last complete checkpoint; killed itself inside the save of S.
  rc, records, err = chain["second"]
  assert rc == -signal.SIGKILL, err
  restored = _restored(records)
  assert restored["step"] == last_complete
  assert restored["all_steps"] == list(range(SAVE_EVERY, last_complete + 1, SAVE_EVERY))
  assert restored["bits"] == reference[last_complete]["bits"]
  _assert_same_steps(_steps(records), reference, range(last_complete + 1, die_in_save + 1))
  assert records[-1]["event"] == "dying_in_save" and records[-1]["step"] == die_in_save
  _assert_interesting(reference, range(last_complete + 1, STEPS + 1))
  if variant == "scaler":
    _assert_state_dict_is_not_enough(restored, reference[last_complete])

  # What the kill left on disk: S written in full under orbax's temporary name.
  listing = chain["listing_after_second"]
  tmp = [name for name in listing if name.startswith(f"{die_in_save}{TMP_SUFFIX}")]
  assert len(tmp) == 1, listing
  assert str(die_in_save) not in listing
  assert listing[tmp[0]], "the half-written checkpoint is not empty"
  assert sorted(listing[tmp[0]]) == sorted(listing[str(die_in_save - SAVE_EVERY)]), (
    "every file of the checkpoint was written before the kill"
  )

  # 3. The resumer takes the last complete step, not the half-written S.
  rc, records, err = chain["third"]
  assert rc == 0, err
  restored = _restored(records)
  assert restored["step"] == die_in_save - SAVE_EVERY == max(_saved(chain["second"][1]))
  assert die_in_save not in restored["all_steps"]
  assert restored["bits"] == reference[restored["step"]]["bits"]
  _assert_same_steps(_steps(records), reference, range(restored["step"] + 1, STEPS + 1))
  assert records[-1]["event"] == "done"
  # The temporary directory is replaced when S is saved again: no debris left.
  final = chain["listing_final"]
  assert not [name for name in final if TMP_SUFFIX in name], final
  assert sorted(int(n) for n in final if n.isdigit()) == list(
    range(SAVE_EVERY, STEPS + 1, SAVE_EVERY)
  )


def _assert_state_dict_is_not_enough(restored: dict, at_checkpoint: dict) -> None:
  """torch's five keys hold the scale and tracker; the counters and the hysteresis
  tracker are only in the scaler's leaves, which is why the worker saves both."""
  saved = restored["saved_state_dict"]
  assert saved["scale"] == at_checkpoint["loss_scale"]
  assert saved["_growth_tracker"] == at_checkpoint["growth_tracker"]
  only = restored["by_state_dict_only"]
  assert only["update_count"] == 0 != at_checkpoint["update_count"]
  assert only["skipped_updates"] == 0 != at_checkpoint["skipped_steps"]
