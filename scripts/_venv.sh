# Sourced by the scripts: creates .venv (once), the one environment of parity.sh,
# test.sh and lint.sh, and installs jaxamp from the checkout (editable) with the
# given extra into it. Python 3.11+ must be on PATH as python3.
#
# The extras add to one another (torch is installed once, for parity and for the
# tests). test.sh replaces the editable install with the wheel it builds; the next
# parity.sh or lint.sh puts the editable install back, so the commands run in any
# order. Both parity.sh and the tests import jaxamp from the checkout or from the
# wheel by design, never from whatever an earlier command left installed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip >/dev/null
.venv/bin/python -m pip install --quiet -e ".[$1]"
