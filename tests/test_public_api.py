"""Every public name imports, is documented, and the core does not need flax/torch."""

import subprocess
import sys

import pytest

import jaxamp


@pytest.mark.parametrize("module", [jaxamp, jaxamp.ops], ids=lambda m: m.__name__)
def test_public_api_names_import_and_are_documented(module):
  assert list(module.__all__) == sorted(module.__all__)
  for name in module.__all__:
    obj = getattr(module, name)
    assert obj.__doc__ and obj.__doc__.strip(), f"{module.__name__}.{name} has no docstring"


def test_public_api_top_level_is_what_a_training_loop_uses():
  # The tiers: a dozen names at the top, the primitives only in jaxamp.ops.
  assert len(jaxamp.__all__) <= 15
  assert not set(jaxamp.__all__) & set(jaxamp.ops.__all__)
  for name in jaxamp.ops.__all__:
    assert not hasattr(jaxamp, name), f"jaxamp.{name} should only be jaxamp.ops.{name}"


@pytest.mark.slow
def test_public_api_core_imports_without_flax_or_torch():
  code = (
    "import sys; sys.modules['flax'] = None; sys.modules['torch'] = None\n"
    "import jaxamp, optax, jax.numpy as jnp\n"
    "tx = jaxamp.dynamic_loss_scale(optax.sgd(0.1))\n"
    "print(float(jaxamp.get_loss_scale(tx.init(jnp.ones(2)))))\n"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "65536.0"


@pytest.mark.parametrize("name", jaxamp.ops.__all__)
def test_public_api_moved_name_names_its_new_home(name):
  # Each of jaxamp.ops' names was a top-level name before 0.2.0 (CHANGELOG.md).
  with pytest.raises(AttributeError, match=rf"^jaxamp\.{name} moved to jaxamp\.ops\.{name} "):
    getattr(jaxamp, name)
  with pytest.raises(AttributeError, match="^module 'jaxamp' has no attribute 'no_such_name'$"):
    jaxamp.no_such_name  # noqa: B018
