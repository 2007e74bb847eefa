#!/usr/bin/env bash
# Sets up .venv with the parity dependencies (torch, scikit-learn, matplotlib,
# tqdm) and runs the parity suite: the same models under torch's GradScaler and
# under jaxamp, compared step by step. Arguments go to python -m parity
# (--list, --scenario NAME, --json PATH, --png PATH).
source "$(dirname "$0")/_venv.sh" parity
exec .venv/bin/python -m parity "$@"
