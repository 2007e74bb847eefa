"""``autocast``: torch's autocast op policy applied to float32 JAX code, as a jaxpr interpreter.

``regions.py`` holds the public ``autocast`` and ``autocast_disabled``;
``interpreter.py`` re-runs a traced program with casts, each equation by the
mode of the nested region it is in (``modes.py``); ``policies.py`` holds
torch's CPU and CUDA op lists as JAX primitives; ``promotion.py`` torch's type
promotion of mixed inputs; ``fused.py`` finds the calls of torch's fused ops
(softmax, GELU, layer norm, ...) in a jaxpr and runs them in float32, rounded
once; ``higher_order.py`` rebuilds the nested jaxprs (``jit``, loops,
``cond``, custom derivatives) with the policy inside. Nothing here reads the
machine it runs on: a program computes the same values on every CPU.
"""

from jaxamp._autocast.regions import autocast, autocast_disabled

__all__ = ["autocast", "autocast_disabled"]
