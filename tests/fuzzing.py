"""Settings shared by the differential fuzzers (``tests/test_fuzz_*.py``).

In CI they run with a fixed seed and a fixed number of examples, so a run is
reproducible and bounded. ``JAXAMP_FUZZ=long`` runs them long, with a random
seed (docs/contributing.md, "Fuzzing")::

  JAXAMP_FUZZ=long .venv/bin/python -m pytest -m fuzz -p no:cacheprovider
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

LONG = os.environ.get("JAXAMP_FUZZ") == "long"


def fuzz_settings(ci_examples: int, *, long_examples: int | None = None, **kwargs) -> settings:
  """``hypothesis.settings`` for a fuzzer: ``ci_examples`` with a fixed seed in
  CI; ``long_examples`` (50x by default) with a random seed when ``JAXAMP_FUZZ=long``."""
  examples = (long_examples or 50 * ci_examples) if LONG else ci_examples
  return settings(
    max_examples=examples,
    derandomize=not LONG,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=list(HealthCheck),
    **kwargs,
  )
