"""The only imports of JAX's private modules (tests/test_jax_internals.py names a moved one).

``checkify``, ``debug_effect``: JAX has no public API to give the skip-limit primitive
(``jaxamp/_skip_limit.py``) a ``checkify`` rule.
"""

from __future__ import annotations

from jax._src import checkify
from jax._src.debugging import debug_effect

__all__ = ["checkify", "debug_effect"]
