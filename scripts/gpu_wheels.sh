#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with what scripts/gpu_check.sh installs on the lent
# GPU machine, which has no package index: run it HERE, before a lease.
#
#   scripts/gpu_wheels.sh     # PYTHON=... picks the interpreter (pip, setuptools>=77)
#
# Only FlashInfer travels: flashinfer-python 0.2.14.post1 (a 3.6 MB source
# archive, kernels JIT-compiled at first use) built here into a pure-Python
# wheel (about 5 MB). Its dependencies are on that machine already (numpy,
# torch, ninja, requests, einops, packaging, nvidia-ml-py) or unneeded by the
# paged prefill/decode wrappers (cuda-python, nvidia-cudnn-frontend).
# transformers stays: the machine's 5.17 serves the HF integration (checked
# here with transformers 5.17.0 + huggingface_hub 1.33.0: test_engine,
# test_hf, test_hf_manager pass, as do the Llama-like architectures).
# Everything that travels must stay under the 64 MiB a call carries.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
FLASHINFER=flashinfer-python==0.2.14.post1
LIMIT=$((48 * 1024 * 1024))  # leaves the working tree room under 64 MiB
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

rm -rf .whl && mkdir .whl
"$PY" -m pip download -q --no-deps --no-binary=:all: --no-build-isolation -d "$tmp" "$FLASHINFER"
"$PY" -m pip wheel -q --no-deps --no-build-isolation --no-index -w .whl "$tmp"/flashinfer_python-*.tar.gz

ls -l .whl
wheels=$(du -cb .whl/*.whl | tail -1 | cut -f1)
tree=$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- | tail -1 | cut -f1)
echo "carry .whl: $((wheels / 1024)) KiB; working tree: $((tree / 1024)) KiB; together $(((wheels + tree) / 1024)) KiB of 65536"
if ((wheels > LIMIT)); then
    echo "too large: .whl holds $wheels bytes, the limit here is $LIMIT" >&2
    exit 1
fi
