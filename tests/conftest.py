import json
import os
import pathlib
import tempfile

import jax
import pytest

HERE = pathlib.Path(__file__).resolve().parent
FIXTURES = HERE / "data" / "torch_fixtures.json"  # copy of shared/torch_reference/fixtures.json
SHARED_FIXTURES = HERE.parents[1] / "shared" / "torch_reference" / "fixtures.json"


def _persistent_compilation_cache() -> None:
  """JAX's persistent compilation cache for the test processes, so that a rerun
  loads the programs an earlier run compiled (about half the CPU time of a warm
  rerun), and a program that several tests or processes of one run compile is
  compiled once. ``JAXAMP_TEST_COMPILATION_CACHE`` names its directory, or
  ``off``. Set through ``jax.config``, not the environment: a subprocess a test
  starts compiles without it unless the test gives it a cache of its own
  (``helpers.compilation_cache_env``). The size limit turns on the cache's file
  lock, which the xdist workers need to share it."""
  path = os.environ.get("JAXAMP_TEST_COMPILATION_CACHE") or os.path.join(
    tempfile.gettempdir(), f"jaxamp-test-compilation-cache-{os.getuid()}"
  )
  if path == "off":
    return
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_compilation_cache_max_size", 2**30)
  _evict_once_per_process()


def _evict_once_per_process() -> None:
  """With a size limit, JAX's cache (``jax._src.lru_cache.LRUCache``) reads the size
  and the access time of every entry before each write, under its lock: the
  suite writes over 4,000 programs, so a cold run read files quadratically, 0.5 s
  per write at the end (a third of its CPU time). Each test process evicts once,
  at its first write, and then writes without the scan: the cache overshoots its
  limit by at most one run's programs (about 70 MB), and the lock stays. Without
  the private method (another JAX), the cache works as JAX ships it, only slower."""
  from jax._src import lru_cache

  evict = getattr(lru_cache.LRUCache, "_evict_if_needed", None)
  if evict is None:
    return
  evicted = set()

  def evict_once(self, *, additional_size=0):
    if self.path not in evicted:
      evicted.add(self.path)
      evict(self, additional_size=additional_size)

  lru_cache.LRUCache._evict_if_needed = evict_once


_persistent_compilation_cache()


@pytest.fixture(scope="session")
def torch_fixtures():
  """The exact torch trajectories of ``shared/torch_reference/fixtures.json``."""
  return {f["name"]: f for f in json.loads(FIXTURES.read_text())}


@pytest.fixture
def backend_compiles():
  """A list that collects one entry per XLA compilation while the test runs, a
  program loaded from the persistent compilation cache counting as one."""
  from jax import monitoring

  compiles = []

  def listener(event, duration, **kwargs):
    if "backend_compile" in event or event == "/jax/compilation_cache/cache_retrieval_time_sec":
      compiles.append(event)

  monitoring.register_event_duration_secs_listener(listener)
  yield compiles
  monitoring.unregister_event_duration_listener(listener)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
  """Marks ``slow`` what the inner loop (``-m "not slow"``, docs/contributing.md) leaves
  out besides the tests marked by hand: the fuzzers, and every parameter set of a
  parametrized test but its first, so that each test function still runs once.

  ``tryfirst``: the marks must be set before pytest's own ``-m`` selection reads them.
  """
  seen = set()
  for item in items:
    if item.get_closest_marker("fuzz"):
      item.add_marker(pytest.mark.slow)
    if getattr(item, "callspec", None) is not None:
      function = item.nodeid.split("[", 1)[0]
      if function in seen:
        item.add_marker(pytest.mark.slow)
      seen.add(function)
