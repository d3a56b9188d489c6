#!/usr/bin/env bash
# The GPU check (benchmarks/gpu/check.py says what it runs). On a lent GPU machine, from the
# repository root, with the carry sent along (make gpu-carry; the device tool's carry: .gpu-carry):
#   bash benchmarks/gpu/check.sh                 # every step, results in $OUT
#   bash benchmarks/gpu/check.sh --only table2   # one step again (the bootstrap always runs)
# The rehearsal on any CPU (what CI runs): make gpu-rehearsal, or bash benchmarks/gpu/check.sh --cpu
set -u
exec "${PYTHON:-python3}" "$(dirname "$0")/check.py" "$@"
