# Sourced by scripts/fuzz_c.sh and scripts/fuzz_py.sh: runs one libFuzzer-style target and
# records its summary line.
#   fuzz_target NAME CORPUS LOG ARTIFACTS_DIR COMMAND...
# runs COMMAND (a fuzzer given its options and corpus directories) with its output in LOG,
# then appends "fuzz-NAME: N executions in S s, crashes: C (exit RC), corpus F files" to
# the array `summary` and sets `status` to 1 on a crash (new files NAME-* in ARTIFACTS_DIR,
# or a non-zero exit, whose log tail goes to stderr).
fuzz_target() {
    local t=$1 corpus=$2 log=$3 artifacts=$4
    shift 4
    local before rc=0 t0 elapsed execs crashes
    before=$(find "$artifacts" -name "$t-*" -type f | wc -l)
    t0=$(date +%s)
    "$@" >"$log" 2>&1 || rc=$?
    elapsed=$(( $(date +%s) - t0 ))
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    if [ -z "$execs" ]; then  # fork mode, or a run that died early, prints its count on status lines
        execs=$(grep -oE '^#[0-9]+' "$log" | tail -1 | tr -d '#')
    fi
    crashes=$(( $(find "$artifacts" -name "$t-*" -type f | wc -l) - before ))
    if [ "$rc" -ne 0 ]; then
        status=1
        [ "$crashes" -gt 0 ] || crashes=1
        tail -40 "$log" >&2
    fi
    summary+=("fuzz-$t: ${execs:-0} executions in ${elapsed} s, crashes: $crashes (exit $rc), corpus $(find "$corpus" -type f | wc -l) files")
}
