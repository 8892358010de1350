#!/usr/bin/env bash
# Re-resolve the pinned test setup (constraints/*.txt) with the packages of the day.
#
#   scripts/refresh_constraints.sh        # then run scripts/test, and commit constraints/ if it passes
#
# Each venv is built from scratch without the old pins, from the same requirements that
# scripts/test and .ci/run install, and frozen. torch stays at pyproject.toml's exact pin (the
# CPU build); a looser requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

freeze() {  # VENV OUT WHAT
  {
    echo "# Pins for $3; written by scripts/refresh_constraints.sh on $(date -u +%F)"
    echo "# with $("$1/bin/python" --version). Do not edit by hand: refresh, test, commit."
    "$1/bin/pip" freeze --exclude-editable  # cadence itself is the editable install
  } > "$2"
}

python3 -m venv "$work/test"
"$work/test/bin/pip" install -q -e '.[test,fast,torch,ray]'
freeze "$work/test" constraints/test.txt "the test venv (.venv): pip install -c constraints/test.txt -e '.[test,fast,torch,ray]'"

python3 -m venv "$work/deploy"
"$work/deploy/bin/pip" install -q -r constraints/deploy.in
freeze "$work/deploy" constraints/deploy.txt "the manifests' validators (.venv-deploy): pip install -c constraints/deploy.txt -r constraints/deploy.in"
echo "constraints/test.txt and constraints/deploy.txt refreshed; run scripts/test before committing them"
