#!/bin/sh
# Installs the bench's speed peer, llama-cpp-python, built from its source distribution for
# this CPU (GGML_NATIVE), into the Python given as $1 (default: python3).
#
# One line of llama.cpp is mended first. On CPUs with AMX, ggml's AMX matmul loads its tile
# configuration from a struct on the stack with ldtilecfg, an instruction GCC 12 does not see
# reading that struct: the stores are dropped, ldtilecfg faults (llama-cpp-python 0.3.36,
# ggml/src/ggml-cpu/amx/mmq.cpp, ggml_tile_config_init). A compiler barrier naming the struct
# keeps them. Without AMX the line is never run and the build is llama.cpp's own.
#
# The bench runs the peer in a process of its own (bench/engine.py, LlamaCppPeer): torch and
# ggml share OpenMP's threads, and one's AMX kernels release the tiles the other configured.
set -eu

PYTHON=${1:-python3}
VERSION=0.3.36
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

"$PYTHON" -m pip download --quiet --no-deps --no-binary :all: \
    "llama-cpp-python==$VERSION" -d "$WORK"
tar -xzf "$WORK/llama_cpp_python-$VERSION.tar.gz" -C "$WORK"
SOURCE="$WORK/llama_cpp_python-$VERSION"
"$PYTHON" - "$SOURCE/vendor/llama.cpp/ggml/src/ggml-cpu/amx/mmq.cpp" <<'EOF'
import sys

path = sys.argv[1]
text = open(path).read()
load = "    _tile_loadconfig(&tc);\n"
barrier = '    asm volatile("" : : "m"(tc) : "memory");  // keep tc\'s stores for ldtilecfg\n'
if barrier not in text:
    if text.count(load) != 1:
        sys.exit(f"install_peer.sh: {path} changed; look at ggml_tile_config_init by hand")
    open(path, "w").write(text.replace(load, barrier + load))
EOF
CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
    CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    "$PYTHON" -m pip install --quiet "$SOURCE"
