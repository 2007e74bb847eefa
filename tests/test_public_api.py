"""Every public name imports, is documented, and the core does not need flax/torch."""

import subprocess
import sys

import jaxamp


def test_public_api_names_import_and_are_documented():
  assert list(jaxamp.__all__) == sorted(jaxamp.__all__)
  for name in jaxamp.__all__:
    obj = getattr(jaxamp, name)
    assert obj.__doc__ and obj.__doc__.strip(), f"jaxamp.{name} has no docstring"


def test_public_api_core_imports_without_flax_or_torch():
  code = (
    "import sys; sys.modules['flax'] = None; sys.modules['torch'] = None\n"
    "import jaxamp, optax, jax.numpy as jnp\n"
    "tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1))\n"
    "print(float(jaxamp.get_loss_scale(tx.init(jnp.ones(2)))))\n"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "65536.0"
