#!/usr/bin/env bash
# Installs what switchyard's MPI backend (`cargo build --features mpi`) needs on Debian
# or Ubuntu: OpenMPI (mpirun, mpicc and the headers) and libclang, which the rsmpi
# crate's build script uses (through bindgen) to generate its bindings.
#
# Idempotent: when everything is already installed it only says so. Runs as root without
# sudo, or through sudo when run as another user. Set SWITCHYARD_APT_UPDATE=0 to skip
# `apt-get update` (for example in an image whose package lists are fresh).
#
#   scripts/install-mpi.sh
#
# See docs/tutorial/08-mpi.md.
set -euo pipefail

packages=(openmpi-bin libopenmpi-dev libclang-dev clang pkg-config)

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-mpi.sh: apt-get not found; install OpenMPI (mpicc, mpirun, headers) and" >&2
    echo "libclang with your system's package manager instead." >&2
    exit 1
fi

missing=()
for p in "${packages[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$p")
    fi
done

if [ "${#missing[@]}" -eq 0 ]; then
    echo "install-mpi.sh: already installed: ${packages[*]}"
else
    if [ "$(id -u)" -eq 0 ]; then
        as_root=()
    elif command -v sudo >/dev/null 2>&1; then
        as_root=(sudo)
    else
        echo "install-mpi.sh: need root (or sudo) to install: ${missing[*]}" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    if [ "${SWITCHYARD_APT_UPDATE:-1}" != "0" ]; then
        "${as_root[@]}" apt-get update
    fi
    "${as_root[@]}" apt-get install -y --no-install-recommends "${missing[@]}"
fi

# Report what the build will find.
mpicc --showme:version 2>/dev/null || mpicc --version | head -n 1
mpirun --version | head -n 1
echo "install-mpi.sh: done"
