#!/usr/bin/env bash
# Runs a script of python/tests under torchrun on this machine, the way users start training:
#   torchrun.sh BUILD_PYTHON_DIR NPROC SCRIPT [ARGS...]
# with the built package on PYTHONPATH (no install), Debian's interpreter (/usr/bin/python3: another
# one first on PATH cannot import Debian's torch), a free port for torchrun's store (its
# --standalone mode always takes 29400, so tests could not run side by side) and --redirects 2
# --tee 2 (Debian's torchrun fails without them on Python 3.11). Exits with torchrun's status.
set -euo pipefail
pydir=$1 nproc=$2 script=$3
shift 3
export PYTHONPATH="$pydir${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=1
port=$(/usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
exec /usr/bin/python3 -m torch.distributed.run --master_addr 127.0.0.1 --master_port "$port" --redirects 2 --tee 2 \
  --nproc_per_node "$nproc" "$script" "$@"
