#!/usr/bin/python3
"""A rank stopped (SIGSTOP) in the middle of `fasta2a run --bootstrap tcp` (issue 50, defect 7).

    tests/tcp_stop.py FASTA2A_BINARY VICTIM [TRIALS]

Starts 4 ranks (2 servers x 2, libfabric over tcp on loopback, --timeout 3000, a job secret as
launch_ranks.sh draws one), lets them run their calls, stops rank VICTIM at a moment drawn from a
fixed seed, and checks, for each of TRIALS trials:
  - every other rank exits with status 2 within the timeout + 2.5 s of the stop (the roll call
    takes at most a second after the timeout);
  - every survivor's error names the victim as not answering a roll call, and no survivor names
    any other rank so: a rank that waits for the stopped one is never blamed for it.
Prints one line per survivor. Exit 0 pass, 1 fail.
"""
import os
import random
import re
import secrets
import select
import socket
import subprocess
import sys
import time

BIN, VICTIM = sys.argv[1], int(sys.argv[2])
TRIALS = int(sys.argv[3]) if len(sys.argv) > 3 else 2
TIMEOUT_S = 3.0
BOUND_S = TIMEOUT_S + 2.5
RANKS = 4


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def start(rank, port, secret):
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(RANKS), LOCAL_RANK=str(rank % 2), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), FI_TCP_IFACE="lo", FASTA2A_FI_PROVIDER="tcp;ofi_rxm", FASTA2A_JOB_SECRET=secret)
    env.pop("FASTA2A_BOOTSTRAP_TIMEOUT", None)  # --timeout bounds the bootstrap too
    cmd = [BIN, "run", "--bootstrap", "tcp", "--transport", "libfabric", "--gpus", "2", "--uniform",
           "--bytes-per-rank", "4M", "--iters", "100000", "--timeout", str(int(TIMEOUT_S * 1000))]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")


def main():
    rng = random.Random(50 + VICTIM)
    failures = 0
    for trial in range(TRIALS):
        port, secret = free_port(), secrets.token_hex(32)
        procs = [start(r, port, secret) for r in range(RANKS)]
        # The header line comes after the start and the first planning: then the calls run.
        ready, _, _ = select.select([procs[0].stdout], [], [], 60)
        first = procs[0].stdout.readline() if ready else "(nothing within 60 s)"
        if not first.startswith("# fasta2a run"):
            print(f"FAIL: the job did not start: {first.strip()}")
            for p in procs:
                p.kill()
            return 1
        time.sleep(rng.uniform(0.5, 2.0))
        procs[VICTIM].send_signal(19)  # SIGSTOP
        t0 = time.time()
        for r, p in enumerate(procs):
            if r == VICTIM:
                continue
            try:
                text, _ = p.communicate(timeout=max(1.0, BOUND_S + 20 - (time.time() - t0)))
            except subprocess.TimeoutExpired:
                p.kill()
                text, _ = p.communicate()
            took = time.time() - t0
            if r == 0:
                text = first + text
            error = next((line for line in text.splitlines() if "error:" in line), "")
            absent = set(int(x) for m in re.finditer(r"ranks? ((?:\d+, )*\d+) do(?:es)? not answer a roll call", error)
                         for x in m.group(1).split(", "))
            good = p.returncode == 2 and took <= BOUND_S and absent == {VICTIM}
            print(f"trial {trial}: rank {r}: exit {p.returncode} after {took:.2f} s (bound {BOUND_S:g} s), "
                  f"named as absent: {sorted(absent)}: {'ok' if good else 'FAIL'}: {error[:400]}", flush=True)
            failures += 0 if good else 1
        procs[VICTIM].kill()
        procs[VICTIM].communicate()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
