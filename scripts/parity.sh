#!/usr/bin/env bash
# Sets up .venv with the parity dependencies (torch, scikit-learn, matplotlib,
# tqdm; the environment test.sh uses too) and runs the parity suite: the same
# models under torch's GradScaler and under jaxamp, compared step by step.
# python -m parity imports jaxamp from this checkout. Arguments go to
# python -m parity (--list, --scenario NAME, --json PATH, --png PATH).
source "$(dirname "$0")/_venv.sh" parity
exec .venv/bin/python -m parity "$@"
