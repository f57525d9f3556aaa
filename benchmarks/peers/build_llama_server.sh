#!/usr/bin/env bash
# Build llama.cpp's own `llama-server` binary from the llama.cpp source vendored in the llama-cpp-python sdist
# (pinned below), for benchmarks only (`make bench-peers`; never the test suite or CI).  Idempotent: a build whose
# stamp matches the pinned sdist is reused; an interrupted build resumes.  Runs under `nice -n 19` with -j2 (issue 43:
# 6-15 minutes on two quiet cores; far longer beside other work).
#   usage: benchmarks/peers/build_llama_server.sh [PEERS_DIR]   (default ~/.cache/kvkeeper/peers)
# Prints the binary's path on its last line.
set -euo pipefail
PEERS_DIR=${1:-${KVKEEPER_PEERS_DIR:-$HOME/.cache/kvkeeper/peers}}
PKG=llama-cpp-python
VERSION=0.3.36
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
PY=${PY:-python3}
JOBS=${JOBS:-2}
SRC_DIR=$PEERS_DIR/src
TARBALL=$SRC_DIR/llama_cpp_python-$VERSION.tar.gz
LLAMA_SRC=$SRC_DIR/llama_cpp_python-$VERSION/vendor/llama.cpp
BUILD_DIR=$PEERS_DIR/llama-server-$VERSION
BIN=$BUILD_DIR/bin/llama-server
STAMP=$BUILD_DIR/.kvkeeper-built
WANT="$PKG==$VERSION sha256=$SHA256 GGML_NATIVE=ON"

if [ -x "$BIN" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$WANT" ]; then
    echo "llama-server ($WANT) already built"
    echo "$BIN"
    exit 0
fi
mkdir -p "$SRC_DIR"
if [ ! -f "$TARBALL" ]; then
    nice -n 19 "$PY" -m pip download --quiet --no-deps --no-binary :all: "$PKG==$VERSION" -d "$SRC_DIR"
fi
echo "$SHA256  $TARBALL" | sha256sum -c --quiet -
if [ ! -f "$LLAMA_SRC/CMakeLists.txt" ]; then
    tar xzf "$TARBALL" -C "$SRC_DIR"
fi
start=$(date +%s)
# LLAMA_USE_PREBUILT_UI=OFF: the web UI's assets would come from a Hugging Face bucket (not needed to benchmark)
nice -n 19 cmake -S "$LLAMA_SRC" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >"$BUILD_DIR.cmake.log" 2>&1 \
    || { tail -40 "$BUILD_DIR.cmake.log"; exit 1; }
nice -n 19 cmake --build "$BUILD_DIR" --target llama-server -j "$JOBS"
echo "$WANT" > "$STAMP"
echo "llama-server built in $(( $(date +%s) - start )) s on $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores"
"$BIN" --version 2>&1 | tail -2 || true
echo "$BIN"
