#!/usr/bin/env bash
# The torch engine's GPU check (benchmarks/gpu_check.py; docs/torch-engine.md, "GPU check").
#
#   benchmarks/gpu_check.sh prepare [PYVER]   here, where pip reaches PyPI: wheels of cadence's
#                                             own dependencies for the GPU machine's Python
#                                             (default 3.12) into build/gpu-wheels (git-ignored,
#                                             ~10 MB; carry it to the GPU machine)
#   benchmarks/gpu_check.sh [ARGS]            on the GPU machine: makes cadence importable (from
#                                             the carried wheels if the image lacks a package),
#                                             then runs gpu_check.py ARGS; results in $OUT
#
# Nothing is downloaded on the GPU machine. torch, transformers, safetensors and tokenizers come
# from its image (python3 there holds PyTorch); gpu_check.py stops with the reason if they don't.
set -u
cd "$(dirname "$0")/.."
WHEELS=${GPU_WHEELS:-build/gpu-wheels}
PY=${PYTHON:-python3}
# cadence's runtime dependencies that the GPU image may lack or hold too old (pyproject.toml).
PACKAGES="grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1
protobuf==7.36.2 pyzmq==27.3.0 msgspec==0.23.0 prometheus-client==0.26.0"

if [ "${1:-}" = prepare ]; then
    pyver=${2:-3.12}
    pip_py=$PY
    [ -x .venv/bin/python ] && pip_py=.venv/bin/python
    mkdir -p "$WHEELS"
    # shellcheck disable=SC2086
    "$pip_py" -m pip download --no-deps --only-binary=:all: --python-version "$pyver" \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$WHEELS" $PACKAGES || exit 1
    du -sh "$WHEELS"
    echo "carry $WHEELS: run(command='bash benchmarks/gpu_check.sh', carry=['$WHEELS'], timeout_s=480)"
    exit 0
fi

check='import sys; sys.path[:0] = ["src"]
import cadence.engines.llama.engine, cadence.worker.batch_scheduler, cadence.client, cadence.serving, cadence.lifecycle.server'
if ! "$PY" -c "$check" 2>/dev/null; then
    if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        deps=${GPU_DEPS:-/tmp/cadence-gpu-deps}
        tag=$("$PY" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
        ls "$WHEELS"/*.whl | grep -v -e "-$tag-" -e "abi3" -e "py3-none" >/dev/null &&
            echo "gpu_check.sh: warning: some wheels in $WHEELS are not for $tag ($PY)"
        mkdir -p "$deps"
        for w in "$WHEELS"/*.whl; do "$PY" -m zipfile -e "$w" "$deps" || exit 1; done
        export PYTHONPATH="$deps${PYTHONPATH:+:$PYTHONPATH}"
        echo "gpu_check.sh: cadence's dependencies from $WHEELS unpacked into $deps"
        "$PY" -c "$check" || echo "gpu_check.sh: cadence still does not import (see above)"
    else
        echo "gpu_check.sh: cadence does not import with $PY and no wheels are in $WHEELS;" \
             "run 'benchmarks/gpu_check.sh prepare' where pip reaches PyPI and carry $WHEELS"
        "$PY" -c "$check" 2>&1 | tail -1
    fi
fi
exec "$PY" benchmarks/gpu_check.py "$@"
