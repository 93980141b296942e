#!/usr/bin/env bash
# The GPU tier on a bare machine: a CUDA build of torch in the system python3,
# no network, a folder of wheels.
#
#     tests/gpu/run.sh [WHEELS]        # WHEELS: default .whl/ (at the repository root)
#
# WHEELS holds the wheels of mpi4py, mpich, pyzmq and tqdm for this python3
# (fetched elsewhere: pip download --only-binary=:all: --python-version 3.X
# mpi4py mpich pyzmq tqdm -d .whl), and pytest's where python3 has none.
# A venv (.venv-gpu/) made from python3 sees python3's torch, numpy and pytest
# through a .pth file naming the directory that holds torch, and takes the four
# packages from the wheels, installed with --no-index --no-deps: nothing is
# downloaded.  Then `pytest -q tests/gpu`, with the venv's mpiexec on PATH.
# Exit status: pytest's; 2 where the machine lacks what is needed, said in one line.
set -euo pipefail

cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
WHEELS=${1:-.whl}
VENV=.venv-gpu
NEEDED=(mpi4py mpich pyzmq tqdm)
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1     # pip must not reach for the network

fail() {
    echo "tests/gpu/run.sh: error: $*" >&2
    exit 2
}

# 1. what the machine must have, checked before anything is made
[ -d "$WHEELS" ] || fail "no wheel folder $WHEELS: give the folder that holds the wheels of" \
    "${NEEDED[*]} (tests/gpu/run.sh WHEELS)"
missing=()
for name in "${NEEDED[@]}"; do
    compgen -G "$WHEELS/${name}-*.whl" >/dev/null || missing+=("$name")
done
[ ${#missing[@]} -eq 0 ] || fail "no wheel of ${missing[*]} in $WHEELS"
command -v "$PYTHON" >/dev/null || fail "no $PYTHON on PATH"
where_torch='import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))'
torch_dir=$("$PYTHON" -c "$where_torch" 2>/dev/null) ||
    fail "$PYTHON cannot import torch: install a CUDA build of torch for it"

# 2. the venv, and the four packages from the wheels: installed before python3's
# directories are in sight, or pip would call a package of python3's installed
started=$SECONDS
"$PYTHON" -m venv "$VENV" ||
    fail "$PYTHON -m venv $VENV failed (Debian: apt-get install python3-venv)"
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -f "$site/system-torch.pth"
"$VENV/bin/python" -m pip install -q --no-index --no-deps --find-links "$WHEELS" "${NEEDED[@]}"

# 3. python3's torch (and what sits beside it) through a .pth file, after the
# venv's own site-packages; pytest from the wheels where python3 has none
echo "$torch_dir" > "$site/system-torch.pth"
if ! "$VENV/bin/python" -c 'import pytest' 2>/dev/null; then
    compgen -G "$WHEELS/pytest-*.whl" >/dev/null || fail "$PYTHON has no pytest, and $WHEELS" \
        "no pytest wheel: add the wheels of pytest, pytest-timeout, pluggy, iniconfig, packaging"
    extra=(pytest pluggy iniconfig packaging)
    compgen -G "$WHEELS/pytest_timeout-*.whl" >/dev/null && extra+=(pytest-timeout)
    "$VENV/bin/python" -m pip install -q --no-index --no-deps --find-links "$WHEELS" "${extra[@]}"
fi
"$VENV/bin/python" -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null ||
    echo "tests/gpu/run.sh: torch sees no GPU here: the GPU tests will be skipped" >&2

# 4. the tier, with the venv's mpiexec
status=0
PATH="$PWD/$VENV/bin:$PATH" "$VENV/bin/python" -m pytest -q tests/gpu || status=$?
echo "tests/gpu/run.sh: pytest exit status $status after $((SECONDS - started)) s" >&2
exit $status
