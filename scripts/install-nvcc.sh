#!/usr/bin/env bash
# Install nvcc, pinned to the GPU machines' CUDA 13.0, from PyPI into a
# Python venv, and print the path of nvcc on stdout (nothing else goes to
# stdout; progress goes to stderr).
#
#   scripts/install-nvcc.sh            install if needed, print the nvcc path
#   scripts/install-nvcc.sh --check    install nothing; print the path, or exit 1
#
#   export NVCC="$(scripts/install-nvcc.sh)"
#   cargo build -p kernels             # embeds every kernels/cuda/*.cu
#
# Environment:
#   NVCC_PREFIX   venv location (default /opt/nvcc, which kernels/build.rs
#                 also searches when NVCC, CUDA_HOME, CUDA_PATH and PATH
#                 give no nvcc). Use e.g. NVCC_PREFIX=$HOME/.local/nvcc
#                 without write access to /opt.
#   PYTHON        the interpreter that creates the venv (default python3).
#
# Why these pins (GPU.md): the GPU machines run CUDA 13.0 (driver and
# toolkit 13.0.88), which rejects PTX of a newer `.version`; and the four
# packages must match one another or ptxas rejects nvcc's PTX
# (`Unsupported .version`). The script is idempotent: an install whose four
# packages are already at these versions is detected from their metadata
# directories without running pip, so a second call returns at once.
set -euo pipefail

PINS=(
  nvidia-cuda-nvcc==13.0.88
  nvidia-cuda-runtime==13.0.96
  nvidia-cuda-crt==13.0.88
  nvidia-nvvm==13.0.88
)
RELEASE="V13.0.88"
PREFIX="${NVCC_PREFIX:-/opt/nvcc}"
PYTHON="${PYTHON:-python3}"

check_only=0
case "${1:-}" in
  "") ;;
  --check) check_only=1 ;;
  -h|--help) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 0 ;;
  *) echo "install-nvcc.sh: unknown argument '$1' (expected --check or nothing)" >&2; exit 2 ;;
esac

log() { echo "install-nvcc.sh: $*" >&2; }

# The venv's site-packages (lib/python3.X/site-packages), if there is one.
site_packages() {
  local d
  for d in "$PREFIX"/lib/python3*/site-packages; do
    [ -d "$d" ] && { echo "$d"; return 0; }
  done
  return 1
}

# Succeeds, printing the nvcc path, when the venv holds exactly the pins
# and that nvcc reports the pinned release.
installed_nvcc() {
  local site pin name version dist nvcc
  site="$(site_packages)" || return 1
  for pin in "${PINS[@]}"; do
    name="${pin%%==*}"
    version="${pin##*==}"
    dist="$site/${name//-/_}-$version.dist-info"
    [ -d "$dist" ] || return 1
  done
  nvcc="$site/nvidia/cu13/bin/nvcc"
  [ -x "$nvcc" ] || return 1
  "$nvcc" --version 2>/dev/null | grep -q "$RELEASE" || return 1
  echo "$nvcc"
}

if nvcc="$(installed_nvcc)"; then
  log "nvcc $RELEASE already installed in $PREFIX"
  echo "$nvcc"
  exit 0
fi
if [ "$check_only" = 1 ]; then
  log "no nvcc $RELEASE in $PREFIX (run scripts/install-nvcc.sh to install it)"
  exit 1
fi

if ! command -v "$PYTHON" >/dev/null 2>&1; then
  log "$PYTHON not found: install Python 3 with its venv module, or set PYTHON"
  exit 1
fi
if [ ! -x "$PREFIX/bin/pip" ]; then
  if ! mkdir -p "$PREFIX" 2>/dev/null || [ ! -w "$PREFIX" ]; then
    log "cannot write $PREFIX: run as a user who can, or set NVCC_PREFIX to a writable folder"
    exit 1
  fi
  log "creating a venv in $PREFIX"
  "$PYTHON" -m venv "$PREFIX" >&2
fi
log "installing ${PINS[*]}"
"$PREFIX/bin/pip" install --disable-pip-version-check --no-input "${PINS[@]}" >&2

if ! nvcc="$(installed_nvcc)"; then
  log "pip finished but $PREFIX holds no nvcc $RELEASE with the pinned packages; look at the pip output above"
  exit 1
fi
log "installed nvcc $RELEASE"
echo "$nvcc"
