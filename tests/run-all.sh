#!/bin/sh
# Every test suite pvgpu has: installs what is needed (via setup.sh), builds,
# then runs unit, scenario and CLI tests and the benchmark smoke run.
# Usage: tests/run-all.sh [BUILD_DIR]
set -eu
cd "$(dirname "$0")/.."
build=${1:-build}
./setup.sh "$build"
meson test -C "$build" --print-errorlogs
# Benchmarks print numbers and assert nothing; run them so they keep working.
meson test -C "$build" --benchmark --print-errorlogs
