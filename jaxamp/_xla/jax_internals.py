"""The only imports of JAX's private modules (``jax._src``), for the JAX range
pyproject.toml states. tests/test_jax_internals.py fails, naming the import,
when a JAX release moves one of them.

- ``is_batched``: whether a value is batched by ``vmap``; ``checkify`` cannot
  check a batched loop, so the in-place step takes ``lax.cond`` there.
- ``checkify``, ``debug_effect``: the ``max_consecutive_skips`` check is one
  primitive that is a host callback under ``jit`` and a ``checkify`` error
  under ``checkify`` (``jaxamp/_skip_limit.py``); JAX has no public API to
  give a primitive a ``checkify`` rule.
"""

from __future__ import annotations

from typing import Any

from jax._src import checkify
from jax._src.debugging import debug_effect
from jax._src.interpreters.batching import BatchTracer

__all__ = ["checkify", "debug_effect", "is_batched"]


def is_batched(x: Any) -> bool:
  """Whether ``x`` is being batched by ``jax.vmap``."""
  return isinstance(x, BatchTracer)
