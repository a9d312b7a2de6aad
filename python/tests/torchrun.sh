#!/usr/bin/env bash
# Runs a script of python/tests under torchrun on this machine, the way users start training:
#   torchrun.sh BUILD_PYTHON_DIR NPROC SCRIPT [ARGS...]
# with the built package on PYTHONPATH (no install), Debian's interpreter (/usr/bin/python3: another
# one first on PATH cannot import Debian's torch), torchrun's --standalone rendezvous (a free port
# of its own, so tests can run side by side) and --redirects 2 --tee 2 (Debian's torchrun fails
# without them on Python 3.11). Exits with torchrun's status.
set -euo pipefail
pydir=$1 nproc=$2 script=$3
shift 3
export PYTHONPATH="$pydir${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=1
exec /usr/bin/python3 -m torch.distributed.run --standalone --redirects 2 --tee 2 --nproc_per_node "$nproc" \
  "$script" "$@"
