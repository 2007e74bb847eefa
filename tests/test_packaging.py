"""The suite tests the package that ships: scripts/test.sh runs it against the wheel."""

import os
import pathlib

import pytest

import jaxamp


def test_packaging_jaxamp_is_the_installed_wheel():
  installed = os.environ.get("JAXAMP_EXPECT_INSTALLED")
  if not installed:
    pytest.skip("run from the checkout, not through scripts/test.sh")
  here = pathlib.Path(jaxamp.__file__).resolve().parent
  assert here == pathlib.Path(installed).resolve(), here
  assert "site-packages" in here.parts, here
  assert (here / "py.typed").exists()
