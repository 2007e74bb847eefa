#!/usr/bin/env bash
# Sets up .venv with the test dependencies and runs the whole test suite.
source "$(dirname "$0")/_venv.sh" test
exec .venv/bin/python -m pytest "$@"
