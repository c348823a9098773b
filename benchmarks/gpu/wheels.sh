#!/usr/bin/env bash
# What `treadle serve` and the `mp` executor need and the GPU machines lack (FastAPI, uvicorn,
# uvloop, httptools, pydantic and theirs; pyzmq), at this venv's versions, as wheels for their Python 3.12 in
# ./.whl, which git ignores. A device call carries it (carry: [".whl"]); check.sh installs it
# there for the serving and worker-process workloads. Run here, on a machine that reaches PyPI,
# before the device call. See README.md here.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .git/info
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
PY="${PYTHON:-.venv/bin/python}"
mapfile -t PINS < <("$PY" -m pip list --format=freeze 2>/dev/null | grep -iE \
    '^(fastapi|starlette|pydantic|pydantic[-_]core|uvicorn|uvloop|httptools|annotated[-_]types|typing[-_]inspection|opentelemetry[-_]api|pyzmq)==')
rm -rf .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "${PINS[@]}"
ls .whl
du -sh .whl
