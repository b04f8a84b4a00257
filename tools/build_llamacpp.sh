#!/usr/bin/env bash
# Builds llama.cpp's llama-server, llama-quantize and llama-perplexity once from the llama.cpp source that the
# pinned llama-cpp-python sdist vendors (PyPI is the only source reachable here), into a cache directory that
# later runs reuse. Usage: tools/build_llamacpp.sh [VERSION] [PREFIX]
# Prints the bin directory on its last line. Skips everything when the three binaries are already there.
set -euo pipefail
# Not the calling make's flags: under `make -j3 deps` they name a jobserver cmake's own make is not given.
unset MAKEFLAGS MFLAGS MAKELEVEL
VERSION="${1:-${LLAMACPP_PY_VERSION:-0.3.36}}"
PREFIX="${2:-${ERNIE_STUDIO_LLAMACPP_HOME:-$HOME/.cache/ernie-studio/llama.cpp}}"
DEST="$PREFIX/llama-cpp-python-$VERSION"
BIN="$DEST/bin"
TOOLS=(llama-server llama-quantize llama-perplexity)

have_all() { for t in "${TOOLS[@]}"; do [ -x "$BIN/$t" ] || return 1; done; }
if have_all; then echo "$BIN"; exit 0; fi

PYTHON="${PYTHON:-python3}"
# The build tree stays until the tools are in place: an interrupted build (it takes tens of minutes on a
# loaded 2-core machine) resumes where it stopped.
WORK="$PREFIX/build-$VERSION"
mkdir -p "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  # --no-binary: the package is source-only on PyPI anyway; --no-deps: we want its vendored llama.cpp, not
  # its Python dependencies.
  "$PYTHON" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
    -d "$WORK" "llama-cpp-python==$VERSION" >&2
  tar -xzf "$WORK"/llama_cpp_python-"$VERSION".tar.gz -C "$WORK"
fi
# Static, no network features (no curl/openssl, no prebuilt web UI download), native CPU flags: the cache is
# per machine (images pass LLAMACPP_CMAKE_ARGS=-DGGML_NATIVE=OFF). Only the three tools we run are built, and
# the code around the kernels at -O1 (tools/llamacpp_lighter.cmake: a fifth less build time).
cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_CURL=OFF -DCMAKE_PROJECT_INCLUDE="$(cd "$(dirname "$0")" && pwd)/llamacpp_lighter.cmake" \
  ${LLAMACPP_CMAKE_ARGS:-} >&2
cmake --build "$WORK/build" --config Release -j "${JOBS:-2}" --target "${TOOLS[@]}" >&2
mkdir -p "$BIN.tmp"
for t in "${TOOLS[@]}"; do cp "$WORK/build/bin/$t" "$BIN.tmp/"; done
# The vendored commit, for `llama-server --version` cross-checks and the report.
(cd "$SRC" && git rev-parse HEAD 2>/dev/null || true) > "$BIN.tmp/LLAMACPP_COMMIT"
echo "$VERSION" > "$BIN.tmp/LLAMA_CPP_PYTHON_VERSION"
rm -rf "$BIN" && mv "$BIN.tmp" "$BIN"
rm -rf "$WORK"
echo "$BIN"
