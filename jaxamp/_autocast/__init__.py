"""``autocast``: torch's autocast op policy applied to float32 JAX code, as a jaxpr interpreter.

``regions.py`` holds the public functions, ``interpreter.py`` the interpreter; each
module's docstring says its part (docs/autocast.md, "How it works"). Nothing here
reads the machine it runs on: a program computes the same values on every CPU.
"""

from jaxamp._autocast.regions import autocast, autocast_disabled

__all__ = ["autocast", "autocast_disabled"]
