import json
import pathlib

import pytest

HERE = pathlib.Path(__file__).resolve().parent
FIXTURES = HERE / "data" / "torch_fixtures.json"  # copy of shared/torch_reference/fixtures.json
SHARED_FIXTURES = HERE.parents[1] / "shared" / "torch_reference" / "fixtures.json"


@pytest.fixture(scope="session")
def torch_fixtures():
  """The exact torch trajectories of ``shared/torch_reference/fixtures.json``."""
  return {f["name"]: f for f in json.loads(FIXTURES.read_text())}


@pytest.fixture
def backend_compiles():
  """A list that collects one entry per XLA compilation while the test runs."""
  from jax import monitoring

  compiles = []

  def listener(event, duration, **kwargs):
    if "backend_compile" in event:
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
