#!/usr/bin/python3
"""Strangers against `fasta2a run --bootstrap tcp` on loopback (issue 50's cases), one line each.

    tests/bootstrap_attacks.py FASTA2A_BINARY [CASE...]

Each case starts a small job of the given binary (2 ranks, libfabric over tcp on loopback) and
does to it what a stranger on the network, or an unlucky operator, could: it prints a Markdown
table row with the case, what each process of the job did (exit status, seconds) and the verdict
(the job ran, or was hurt). Run it against two builds to compare them (docs/SECURITY.md has the
figures). The job secret, where the binary reads one, is drawn here as launch_ranks.sh draws it.
"""
import os
import re
import resource
import secrets
import socket
import struct
import subprocess
import sys
import time

BIN = sys.argv[1]
ONLY = sys.argv[2:]
RUN = ["run", "--bootstrap", "tcp", "--transport", "libfabric", "--gpus", "2", "--uniform", "--timeout", "5000"]
SMALL = ("--bytes-per-rank", "64K", "--iters", "1")


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def env_of(rank, port, secret, size=2, extra=None):
    e = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
             MASTER_PORT=str(port), FI_TCP_IFACE="lo", FASTA2A_FI_PROVIDER="tcp;ofi_rxm",
             FASTA2A_BOOTSTRAP_TIMEOUT="5")
    if secret:
        e["FASTA2A_JOB_SECRET"] = secret
    e.update(extra or {})
    return e


def start(rank, port, secret, size=2, extra=None, preexec=None, args=()):
    return subprocess.Popen([BIN] + RUN + list(args or SMALL), env=env_of(rank, port, secret, size, extra), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace", preexec_fn=preexec)


def finish(procs, t0, limit=60):
    out = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=max(1, limit - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
        out.append((p.returncode, time.time() - t0, text))
    return out


def wait_listening(port, limit=5.0):
    t = time.time()
    while time.time() - t < limit:
        r = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True).stdout
        if r.strip():
            return r.split()[3] if len(r.split()) > 3 else r.strip()
        time.sleep(0.02)
    return ""


def ok(text):
    return "all correct" in text


def row(case, results, verdict, note=""):
    procs = "; ".join(f"{name}: exit {rc}, {t:.1f} s" for name, (rc, t, _) in results)
    print(f"| {case} | {procs} | {verdict} | {note} |", flush=True)


def old_hello(rank, size, name=b""):
    return struct.pack("<IIiiH", 0x42324146, 1, rank, size, len(name)) + name


def case_one_packet():
    port, sec = free_port(), secrets.token_hex(32)
    t0 = time.time()
    a0 = start(0, port, sec)
    wait_listening(port)
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.send(old_hello(7, 2))
        time.sleep(0.3)
    time.sleep(0.5)
    a1 = start(1, port, sec)
    r = finish([a0, a1], t0)
    row("one packet (hello for rank 7 of 2) before rank 1 joins", [("rank 0", r[0]), ("rank 1", r[1])],
        "job ran" if ok(r[0][2]) else "job aborted")


def case_impostor():
    port, sec = free_port(), secrets.token_hex(32)
    t0 = time.time()
    a0 = start(0, port, sec)
    wait_listening(port)
    s = socket.create_connection(("127.0.0.1", port))
    s.send(old_hello(1, 2, b"impostor"))  # the old protocol's hello, which that root believed
    s.settimeout(3)
    time.sleep(0.3)
    a1 = start(1, port, sec)
    got = b""
    try:
        while True:
            b = s.recv(65536)
            if not b:
                break
            got += b
    except OSError:
        pass
    r = finish([a0, a1], t0)
    row("an impostor claims rank 1 first", [("rank 0", r[0]), ("real rank 1", r[1])],
        "job ran" if ok(r[0][2]) else "job hurt", f"the impostor received {len(got)} bytes")


def case_two_jobs():
    port = free_port()
    sa, sb = secrets.token_hex(32), secrets.token_hex(32)
    t0 = time.time()
    a0 = start(0, port, sa)
    wait_listening(port)
    b0 = start(0, port, sb)  # cannot listen: the port is A's
    b1 = start(1, port, sb)
    time.sleep(0.5)
    a1 = start(1, port, sa)
    r = finish([a0, a1, b0, b1], t0)
    swapped = ok(r[0][2]) and r[3][0] == 0
    row("two jobs on one port (B's rank 1 arrives first)", [("A0", r[0]), ("A1", r[1]), ("B0", r[2]), ("B1", r[3])],
        "ranks swapped between jobs" if swapped else ("A ran, B refused" if ok(r[0][2]) and r[3][0] != 0 else "A hurt"))


def case_escapes():
    port, sec = free_port(), secrets.token_hex(32)
    t0 = time.time()
    a0 = start(0, port, sec)
    wait_listening(port)
    evil = b"x\n\x1b[32mfasta2a: all ranks finished OK\x1b[0m"
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.send(old_hello(5, 2, evil))
        time.sleep(0.3)
    a1 = start(1, port, sec)
    r = finish([a0, a1], t0)
    raw = any("\x1b" in t for _, _, t in r)
    row("a hello whose name holds a newline and terminal escapes", [("rank 0", r[0]), ("rank 1", r[1])],
        "escapes printed raw" if raw else "nothing raw printed", "job ran" if ok(r[0][2]) else "job aborted")


def case_listen():
    port, sec = free_port(), secrets.token_hex(32)
    t0 = time.time()
    a0 = start(0, port, sec)
    where = wait_listening(port)
    a1 = start(1, port, sec)
    r = finish([a0, a1], t0)
    row("where rank 0 listens (MASTER_ADDR=127.0.0.1)", [("rank 0", r[0]), ("rank 1", r[1])], f"listens on {where}")


def case_file_limit():
    port, sec = free_port(), secrets.token_hex(32)
    size = 100

    def limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.time()
    a0 = start(0, port, sec, size=size, preexec=limit)
    wait_listening(port)
    socks = []
    for _ in range(size - 1):
        try:
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=1))
        except OSError:
            break
    r = finish([a0], t0)
    for s in socks:
        s.close()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    named = "limit of open files" in r[0][2]
    row(f"root with 64 open files, {size - 1} connections", [("rank 0", r[0])],
        f"{cpu:.1f} s of CPU", "names the file limit" if named else "does not name the file limit")


def case_stopped_root():
    port, sec = free_port(), secrets.token_hex(32)
    t0 = time.time()
    procs = [start(k, port, sec, size=4, extra={"FASTA2A_BOOTSTRAP_TIMEOUT": ""},
                   args=("--bytes-per-rank", "16M", "--iters", "200")) for k in range(4)]
    time.sleep(3)  # they are in their calls by then (200 of 16 MiB per rank); then rank 0 stops
    procs[0].send_signal(19)  # SIGSTOP
    t1 = time.time()
    r = finish(procs[1:], t1, limit=90)
    procs[0].kill()
    procs[0].communicate()
    named = [bool(re.search(r"rank 0\b", t)) for _, _, t in r]
    row("rank 0 stopped mid-run, --timeout 5000 (4 ranks)", [(f"rank {k + 1}", x) for k, x in enumerate(r)],
        f"slowest survivor {max(t for _, t, _ in r):.1f} s after the stop", f"survivors naming rank 0: {sum(named)} of 3")


def case_late_rank():
    port, sec = free_port(), secrets.token_hex(32)
    t0 = time.time()
    root = start(0, port, sec, extra={"FASTA2A_BOOTSTRAP_TIMEOUT": "2"})
    time.sleep(2.5)  # the root gives up on rank 1 after 2 s
    late = start(1, port, sec, extra={"FASTA2A_BOOTSTRAP_TIMEOUT": "2"})
    r = finish([root, late], t0)
    said = next((line for line in r[1][2].splitlines() if "error" in line), "")
    told = "given up" in said and "UTC" in said
    row("rank 1 starts 0.5 s after the root gave up (2 s timeout)", [("rank 0", r[0]), ("rank 1", r[1])],
        "told why and when" if told else "not told why", said.split(": ", 3)[-1][:90])


CASES = {"one_packet": case_one_packet, "impostor": case_impostor, "two_jobs": case_two_jobs,
         "escapes": case_escapes, "listen": case_listen, "file_limit": case_file_limit,
         "stopped_root": case_stopped_root, "late_rank": case_late_rank}

print(f"| case ({os.path.basename(os.path.dirname(os.path.dirname(os.path.abspath(BIN))))}) | processes | verdict | note |")
print("|---|---|---|---|")
for name, fn in CASES.items():
    if not ONLY or name in ONLY:
        fn()
