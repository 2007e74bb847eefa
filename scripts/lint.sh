#!/usr/bin/env bash
# Sets up .venv with ruff and mypy (the environment of parity.sh and test.sh);
# checks lint and formatting of the whole tree and the types of jaxamp/
# (configuration in pyproject.toml). Fails on any finding.
source "$(dirname "$0")/_venv.sh" lint
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
