"""The only imports of JAX's private modules (``jax._src``), for the JAX range
pyproject.toml states. tests/test_jax_internals.py fails, naming the import,
when a JAX release moves one of them.

- ``checkify``, ``debug_effect``: the ``max_consecutive_skips`` check is one
  primitive that is a host callback under ``jit`` and a ``checkify`` error
  under ``checkify`` (``jaxamp/_skip_limit.py``); JAX has no public API to
  give a primitive a ``checkify`` rule.
"""

from __future__ import annotations

from jax._src import checkify
from jax._src.debugging import debug_effect

__all__ = ["checkify", "debug_effect"]
