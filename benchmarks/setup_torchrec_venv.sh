#!/usr/bin/env bash
# Builds benchmarks/.venv-torchrec: TorchRec 1.8.0 for the `torchrec_dmp` variant of
# benchmarks/e2e_bench.py. A separate venv on purpose: TorchRec is never a dependency of
# lightning_shardrec (it pins torchmetrics==1.0.3, which the library's stack does not),
# and lightning_shardrec never imports it. Idempotent: re-running skips a complete venv.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${TORCHREC_VENV:-$HERE/.venv-torchrec}"
PYTHON="${PYTHON:-python3}"
PY="$VENV/bin/python"
STAMP="$VENV/.installed-torchrec-1.8.0"

if [[ -f "$STAMP" ]]; then
    echo "$VENV: already set up (rm $STAMP to redo)"
    exit 0
fi
test -x "$PY" || "$PYTHON" -m venv "$VENV"
"$PY" -m pip install --quiet --upgrade pip
# Check the pinned versions are findable before installing anything large.
for req in "torch==2.13.0" "fbgemm-gpu-cpu==1.8.0" "torchrec==1.8.0" "torchmetrics==1.0.3"; do
    "$PY" -m pip download --quiet --no-deps --dest "$VENV/.probe" "$req" >/dev/null \
        || { echo "setup_torchrec_venv: pip cannot find $req" >&2; exit 1; }
done
rm -rf "$VENV/.probe"
"$PY" -m pip install --quiet "torch==2.13.0" "fbgemm-gpu-cpu==1.8.0"
"$PY" -m pip install --quiet --no-deps "torchrec==1.8.0"
"$PY" -m pip install --quiet tensordict tqdm pyre-extensions iopath "torchmetrics==1.0.3"
"$PY" -c "import torchrec, fbgemm_gpu, torch; print('torchrec', torchrec.__version__ if hasattr(torchrec, '__version__') else '1.8.0', 'torch', torch.__version__)"
touch "$STAMP"
