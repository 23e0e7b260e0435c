#!/usr/bin/env bash
# A longer schemathesis campaign against `python -m powerinfer_py.server` (SmolLM2-135M, on
# 127.0.0.1): tests/test_server_schema.py with more generated examples per operation.
# Usage: scripts/schema_server.sh [MAX_EXAMPLES] [TIME_LIMIT_S]
#   MAX_EXAMPLES  hypothesis examples per operation in the fuzzing phase (default 600; the
#                 CI test uses 10); the examples and coverage phases add ~1000 more requests
#   TIME_LIMIT_S  the whole run is stopped after this many seconds (default 600)
# Environment: SCHEMA_SEED (schemathesis' seed; default: random, printed in the summary).
#
# Prints: requests sent (one per generated example) by status and by operation, streams
# and their events, duration, failed tests and 5xx responses; the server must still run
# and answer a normal completion at the end (the test module's last test). Exits non-zero
# on any failure or when the time limit cut the run short.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

MAX_EXAMPLES=${1:-600}
TIME_LIMIT=${2:-600}
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

echo "==> schemathesis on the server's /openapi.json: $MAX_EXAMPLES examples per operation, at most ${TIME_LIMIT}s"
started=$(date +%s)
set +e
SCHEMA_MAX_EXAMPLES=$MAX_EXAMPLES SCHEMA_SUMMARY_JSON=$WORK/summary.json SCHEMA_SEED=${SCHEMA_SEED:-} \
    timeout --signal=INT --kill-after=30 "$TIME_LIMIT" \
    "$PYTHON" -m pytest tests/test_server_schema.py -q -p no:cacheprovider \
    --junitxml="$WORK/junit.xml" 2>&1 | tail -n 60
status=${PIPESTATUS[0]}
set -e
elapsed=$(($(date +%s) - started))

"$PYTHON" - "$WORK" "$status" "$elapsed" <<'EOF'
import json, os, sys
import xml.etree.ElementTree as ET

work, status, elapsed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
summary = {}
if os.path.exists(os.path.join(work, "summary.json")):
    with open(os.path.join(work, "summary.json")) as f:
        summary = json.load(f)
tests = failures = 0
if os.path.exists(os.path.join(work, "junit.xml")):
    for suite in ET.parse(os.path.join(work, "junit.xml")).getroot().iter("testsuite"):
        tests += int(suite.get("tests", 0))
        failures += int(suite.get("failures", 0)) + int(suite.get("errors", 0))
print("==> summary")
print(f"requests (examples sent): {summary.get('requests', '?')}")
print(f"by status:                {summary.get('by_status', '?')}")
for operation, n in summary.get("by_operation", {}).items():
    print(f"    {operation:32s} {n}")
print(f"streams / their events:   {summary.get('streams', '?')} / {summary.get('stream_events', '?')}")
print(f"duration:                 {elapsed} s (server up {summary.get('duration_s', '?')} s, "
      f"{summary.get('seconds_in_requests', '?')} s in requests, slowest {summary.get('slowest_request_s', '?')} s)")
print(f"tests failed:             {failures} of {tests} (seed {summary.get('seed', '?')})")
print(f"5xx responses:            {summary.get('responses_5xx', '?')}")
print(f"server alive at the end:  {summary.get('server_alive_at_end', '?')} "
      f"(tracebacks in its log: {summary.get('server_tracebacks', '?')})")
if status in (124, 130, 137):
    print(f"the run was stopped by the {elapsed} s time limit")
sys.exit(0 if status == 0 and failures == 0 and summary.get("responses_5xx") == 0 else 1)
EOF
