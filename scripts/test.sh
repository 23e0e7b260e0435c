#!/usr/bin/env bash
# Set up (if needed), fetch the real test models and tokenizer fixtures, run the test suite.
# Usage: scripts/test.sh [pytest arguments, e.g. -k tokenizer -x]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

./scripts/setup.sh

printf '\n==> %s\n' "test assets (models + llama.cpp tokenizer fixtures)"
.venv/bin/python -m powerinfer_py.assets.models fetch all
.venv/bin/python -m powerinfer_py.assets.models vocab-fixtures

printf '\n==> %s\n' "pytest"
exec .venv/bin/python -m pytest -q tests "$@"
