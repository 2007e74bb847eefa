"""``autocast``: torch's autocast op policy applied to float32 JAX code, as a jaxpr interpreter.

``interpreter.py`` re-runs a traced program with casts; ``policies.py`` holds
torch's CPU and CUDA op lists as JAX primitives; ``fused.py`` finds the calls
of torch's fused ops (softmax, GELU, layer norm, ...) in a jaxpr; ``regions.py``
the public ``autocast`` and ``autocast_disabled``.
"""

from jaxamp._autocast.regions import autocast, autocast_disabled

__all__ = ["autocast", "autocast_disabled"]
