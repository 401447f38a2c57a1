#!/usr/bin/env bash
# The GPU check, offline and bounded (about 8 minutes at most on an H200,
# FlashInfer's JIT compile included); its last line is "N passed, M failed".
#
#   scripts/gpu_check.sh             # on the lent GPU machine (see README, "GPU check")
#   scripts/gpu_check.sh --dry-run   # anywhere: only what needs no CUDA, in seconds
#
# It fetches nothing: the interpreter's torch is used as it is, and only the
# wheels in .whl/ (filled beforehand by scripts/gpu_wheels.sh) are installed,
# with --no-index into a temporary folder on PYTHONPATH. PYTHON picks the
# interpreter (default python3); logs and the timing table go to $OUT (or
# /tmp/gpu_check). The stages are in scripts/gpu_check.py.
set -uo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" scripts/gpu_check.py "$@"
