#!/bin/sh
# The pvgpu-sim command-line contract: exit codes, error messages naming the
# problem, --json, --series and --trace output.  Usage: test_cli.sh PVGPU_SIM SCENARIO_DIR
set -u
sim=$1
dir=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
passed=0
failed=0

ok() { passed=$((passed + 1)); }
bad() { failed=$((failed + 1)); echo "FAIL: $*"; }

# expect CODE PATTERN -- ARGS...: exit code CODE and PATTERN in stdout+stderr
expect() {
    code=$1 pattern=$2
    shift 3
    out=$("$sim" "$@" 2>&1)
    rc=$?
    if [ "$rc" -ne "$code" ]; then bad "pvgpu-sim $* exited $rc, wanted $code: $out"; return; fi
    if ! printf '%s' "$out" | grep -q -- "$pattern"; then bad "pvgpu-sim $*: no '$pattern' in: $out"; return; fi
    ok
}

expect 0 "Usage: pvgpu-sim" -- --help
expect 0 "pvgpu-sim 0" -- --version
expect 0 "hfq" -- policies
expect 0 "ok" -- check "$dir/flat.json"
expect 0 "max share error" -- run "$dir/flat.json" --duration-ms 500 --warmup-ms 100
expect 0 "hfq" -- compare "$dir/flat.json" --duration-ms 500 --warmup-ms 100
expect 2 "no command" --
expect 2 "unknown command" -- frobnicate
expect 2 "unknown option" -- run "$dir/flat.json" --frob
expect 2 "unknown policy" -- run "$dir/flat.json" --policy nosuch
expect 2 "no parameter" -- run "$dir/flat.json" --param nosuch=1
expect 2 "round-robin or timeslice" -- run "$dir/flat.json" --arbitration fifo
expect 2 "No such file" -- run "$tmp/missing.json"
expect 2 "whole number" -- run "$dir/flat.json" --seed 1.5
expect 2 "duration must be between" -- run "$dir/flat.json" --duration-ms inf
expect 2 "series-interval-ms must be" -- run "$dir/flat.json" --series "$tmp/never.csv" --series-interval-ms 0.0000001
expect 2 "compare takes --policies" -- compare "$dir/flat.json" --policy hfq
expect 2 "belongs to compare" -- run "$dir/flat.json" --policies none,hfq
expect 2 "none of the compared policies" -- compare "$dir/flat.json" --param nosuch=1
expect 2 "timeslice-us must be" -- run "$dir/flat.json" --timeslice-us 0.0000001
if [ -e "$tmp/never.csv" ]; then bad "a rejected run created its series file"; else ok; fi

printf '{"name": "x", "duration_ms": 10, "tree": [' > "$tmp/truncated.json"
expect 2 "invalid JSON" -- run "$tmp/truncated.json"
printf '{"name": "x", "duration_ms": 10, "tree": []}' > "$tmp/empty.json"
expect 2 "tree" -- run "$tmp/empty.json"
printf '{"name": "x", "duration_ms": 10, "tree": [{"task": "a", "weight": 0, "workload": {"kernel_us": 5}}]}' > "$tmp/w0.json"
expect 2 "tree\[0\].weight" -- run "$tmp/w0.json"
printf '{"name": "x", "duration_ms": 10, "colour": 1, "tree": [{"task": "a", "workload": {"kernel_us": 5}}]}' > "$tmp/unknown.json"
expect 2 "colour" -- run "$tmp/unknown.json"

# --json is valid JSON with the fields the design names.
"$sim" run "$dir/flat.json" --json --duration-ms 500 --warmup-ms 100 > "$tmp/r.json" 2>&1
if python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); [r[k] for k in ("scenario","policy","sim_time_ms","gpu","entities","metrics")]; r["metrics"]["max_share_error"]; r["entities"][0]["target_share"]' "$tmp/r.json"; then ok; else bad "--json report malformed"; fi

# --series writes a header and one row per interval.
"$sim" run "$dir/flat.json" --series "$tmp/s.csv" --series-interval-ms 100 --duration-ms 1000 --warmup-ms 100 > /dev/null
rows=$(wc -l < "$tmp/s.csv")
if [ "$(head -1 "$tmp/s.csv")" = "time_ms,k100us,k500us,k2ms,k8ms" ] && [ "$rows" -eq 11 ]; then ok; else bad "series: $rows rows, header $(head -1 "$tmp/s.csv")"; fi

# --trace: every run and submission; the runs add up to each entity's GPU
# time in the report, and docs/waits.py reads the file.
"$sim" run "$dir/flat.json" --json --trace "$tmp/t.csv" --duration-ms 1000 --warmup-ms 100 > "$tmp/t.json"
if python3 - "$tmp/t.csv" "$tmp/t.json" <<'PY'
import csv, json, sys
rows = list(csv.DictReader(open(sys.argv[1])))
rep = json.load(open(sys.argv[2]))
ran, subs = {}, {}
for r in rows:
    if r["event"] == "run":
        ran[r["entity"]] = ran.get(r["entity"], 0) + float(r["end_us"]) - float(r["start_us"])
    else:
        subs[r["entity"]] = subs.get(r["entity"], 0) + 1
for e in rep["entities"]:
    assert abs(ran[e["path"]] / 1000 - e["gpu_time_total_ms"]) < 1e-3 * len(rows), e["path"]
    assert subs[e["path"]] >= e["kernels_completed"], e["path"]
PY
then ok; else bad "--trace does not add up to the report"; fi
waits=$(python3 "$(dirname "$0")/../../docs/waits.py" "$tmp/t.csv" k100us --from-ms 100 2>&1)
if printf '%s' "$waits" | grep -q "^| k8ms |"; then ok; else bad "docs/waits.py on a trace: $waits"; fi
expect 2 "not --policy, --series, --series-interval-ms or --trace" -- compare "$dir/flat.json" --trace "$tmp/never.csv"

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
