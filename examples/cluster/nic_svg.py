#!/usr/bin/env python3
"""Measured per-NIC activity of the emulated cluster, as an SVG.

  nic_svg.py sample --out FILE --ifaces IF0,IF1,... [--interval 0.05]
      Samples the kernel's byte counters of the NICs' bridge ends (root namespace) until killed
      (SIGTERM or SIGINT): one line per sample, CLOCK_MONOTONIC seconds then, per NIC in rank
      order, the bytes its rank has sent and received so far.

  nic_svg.py draw --samples FILE --results JSONL --workload LABEL --out SVG
                  [--methods mpi_alltoallv,fast] [--gpus G] [--rate-mbit R]
      For each method, takes the timed call of median time from the benchmark's JSON lines
      (cluster_bench's "windows", CLOCK_MONOTONIC like the samples) and draws one lane per NIC:
      receive throughput as a filled area, send throughput as a line, both against the NIC's rate.
      Methods side by side on one time scale, with the scale-out lower bound (LB_server) marked.
"""
import argparse
import json
import signal
import sys
import time


def cmd_sample(a):
    ifaces = [i for i in a.ifaces.split(",") if i]
    paths = []
    for i in ifaces:  # the bridge end's rx is the rank's tx and the other way round
        paths.append((f"/sys/class/net/{i}/statistics/rx_bytes", f"/sys/class/net/{i}/statistics/tx_bytes"))
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    files = [(open(t, "rb", buffering=0), open(r, "rb", buffering=0)) for t, r in paths]
    with open(a.out, "w") as out:
        out.write("# t_monotonic_s " + " ".join(f"{i}.tx {i}.rx" for i in ifaces) + "\n")
        next_t = time.monotonic()
        while not stop:
            now = time.monotonic()
            vals = []
            for ft, fr in files:
                ft.seek(0)
                fr.seek(0)
                vals.append(ft.read().strip().decode())
                vals.append(fr.read().strip().decode())
            out.write(f"{now:.6f} " + " ".join(vals) + "\n")
            out.flush()
            next_t += a.interval
            delay = next_t - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            else:
                next_t = time.monotonic()
    return 0


def load_samples(path):
    rows = []
    with open(path) as f:
        for line in f:
            if line.startswith("#") or not line.strip():
                continue
            parts = line.split()
            rows.append((float(parts[0]), [int(x) for x in parts[1:]]))
    return rows


def median_window(rec):
    times = rec["times_s"]
    order = sorted(range(len(times)), key=lambda k: times[k])
    k = order[(len(order) - 1) // 2]
    return rec["windows"][k], times[k]


def rates(samples, t0, t1, nics):
    """Per NIC, [(t_mid - t0, tx_mbit, rx_mbit)] over the samples spanning [t0, t1]."""
    sel = [s for s in samples if t0 - 0.1 <= s[0] <= t1 + 0.1]
    out = [[] for _ in range(nics)]
    for (ta, va), (tb, vb) in zip(sel, sel[1:]):
        dt = tb - ta
        if dt <= 0:
            continue
        if tb <= t0 or ta >= t1:
            continue
        for n in range(nics):
            tx = (vb[2 * n] - va[2 * n]) * 8 / dt / 1e6
            rx = (vb[2 * n + 1] - va[2 * n + 1]) * 8 / dt / 1e6
            out[n].append((ta - t0, tb - t0, tx, rx))
    return out


def esc(s):
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def cmd_draw(a):
    samples = load_samples(a.samples)
    if len(samples) < 2:
        print("nic_svg.py: too few samples in " + a.samples, file=sys.stderr)
        return 2
    recs = {}
    first, last = samples[0][0], samples[-1][0]
    with open(a.results) as f:
        for line in f:
            line = line.strip()
            if not line.startswith("{"):
                continue
            r = json.loads(line)
            # the run that was sampled: its calls lie inside the samples' time span
            if r.get("workload") == a.workload and r.get("windows") and \
                    first <= r["windows"][0][0] and r["windows"][-1][1] <= last:
                recs[r["method"]] = r
    methods = [m for m in a.methods.split(",") if m]
    missing = [m for m in methods if m not in recs]
    if missing:
        print(f"nic_svg.py: no results for {', '.join(missing)} on {a.workload} within the samples' time span",
              file=sys.stderr)
        return 2
    nics = (len(samples[0][1])) // 2
    G = a.gpus or recs[methods[0]]["gpus"]
    rate = a.rate_mbit or recs[methods[0]]["rate_mbit"]
    lb = recs[methods[0]]["lb_server_s"]
    panels = []
    for m in methods:
        (t0, t1), dur = median_window(recs[m])
        panels.append((m, t0, t1, dur, rates(samples, t0, t1, nics)))
    span = max(p[3] for p in panels) * 1.08
    names = {"mpi_alltoallv": "MPI_Alltoallv", "fast": "FAST (Birkhoff)", "fast-bottleneck": "FAST (bottleneck)",
             "fast-quantized": "FAST (quantized)", "direct": "fasta2a direct",
             "spread-out": "fasta2a spread-out"}

    lane_h, gap, left, top, pw, pgap = 22, 3, 70, 62, 470, 40
    height = top + nics * (lane_h + gap) + (nics // G) * 4 + 60
    width = left + len(panels) * (pw + pgap) + 10
    sx = pw / span
    o = []
    o.append(f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'font-family="sans-serif" font-size="11">')
    o.append(f'<rect width="{width}" height="{height}" fill="white"/>')
    r0 = recs[methods[0]]
    o.append(f'<text x="{left}" y="18" font-size="14" font-weight="bold">{esc(a.workload)}: measured NIC activity, '
             f'{r0["servers"]} servers x {r0["gpus"]} ranks, {rate:g} Mbit/s per NIC</text>')
    o.append(f'<text x="{left}" y="34" fill="#444">one timed call of median time per method; per NIC: received '
             f'(blue area) and sent (orange line), full lane = {rate:g} Mbit/s; sampled every ~50 ms from the '
             f'kernel counters</text>')
    for pi, (m, t0, t1, dur, lanes) in enumerate(panels):
        x0 = left + pi * (pw + pgap)
        o.append(f'<text x="{x0}" y="{top - 8}" font-size="12" font-weight="bold">{esc(names.get(m, m))}: '
                 f'{dur:.2f} s ({dur / lb:.2f}x LB_server)</text>')
        y = top
        for n in range(nics):
            if n > 0 and n % G == 0:
                y += 4
            if pi == 0:
                o.append(f'<text x="{left - 6}" y="{y + lane_h - 7}" text-anchor="end">s{n // G} r{n}</text>')
            o.append(f'<rect x="{x0}" y="{y}" width="{pw}" height="{lane_h}" fill="#f4f4f4"/>')
            pts_rx = [f"{x0},{y + lane_h}"]
            pts_tx = []
            for ta, tb, tx, rx in lanes[n]:
                xa = x0 + max(0.0, min(span, ta)) * sx
                xb = x0 + max(0.0, min(span, tb)) * sx
                hy_rx = y + lane_h - min(1.05, rx / rate) * lane_h
                hy_tx = y + lane_h - min(1.05, tx / rate) * lane_h
                pts_rx += [f"{xa:.1f},{hy_rx:.1f}", f"{xb:.1f},{hy_rx:.1f}"]
                pts_tx += [f"{xa:.1f},{hy_tx:.1f}", f"{xb:.1f},{hy_tx:.1f}"]
            if len(pts_rx) > 1:
                last_x = pts_rx[-1].split(",")[0]
                pts_rx.append(f"{last_x},{y + lane_h}")
                o.append(f'<polygon points="{" ".join(pts_rx)}" fill="#4a7fc1" fill-opacity="0.75"/>')
            if pts_tx:
                o.append(f'<polyline points="{" ".join(pts_tx)}" fill="none" stroke="#e8871e" stroke-width="1.2"/>')
            y += lane_h + gap
        # the call itself and the lower bound
        xe = x0 + dur * sx
        o.append(f'<line x1="{x0}" y1="{top}" x2="{x0}" y2="{y}" stroke="#2a2" stroke-width="1"/>')
        o.append(f'<line x1="{xe:.1f}" y1="{top}" x2="{xe:.1f}" y2="{y}" stroke="#2a2" stroke-width="1"/>')
        xl = x0 + lb * sx
        o.append(f'<line x1="{xl:.1f}" y1="{top}" x2="{xl:.1f}" y2="{y}" stroke="#c22" stroke-dasharray="4,3"/>')
        o.append(f'<text x="{xl + 3:.1f}" y="{y + 12}" fill="#c22">LB_server {lb:.2f} s</text>')
        # time axis
        step = 0.5 if span <= 4 else 1.0 if span <= 10 else 2.0
        t = 0.0
        while t <= span + 1e-9:
            xt = x0 + t * sx
            o.append(f'<line x1="{xt:.1f}" y1="{y}" x2="{xt:.1f}" y2="{y + 4}" stroke="#000"/>')
            o.append(f'<text x="{xt:.1f}" y="{y + 26}" text-anchor="middle">{t:g} s</text>')
            t += step
    o.append("</svg>")
    with open(a.out, "w") as f:
        f.write("\n".join(o) + "\n")
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sample")
    s.add_argument("--out", required=True)
    s.add_argument("--ifaces", required=True)
    s.add_argument("--interval", type=float, default=0.05)
    d = sub.add_parser("draw")
    d.add_argument("--samples", required=True)
    d.add_argument("--results", required=True)
    d.add_argument("--workload", required=True)
    d.add_argument("--out", required=True)
    d.add_argument("--methods", default="mpi_alltoallv,fast")
    d.add_argument("--gpus", type=int, default=0)
    d.add_argument("--rate-mbit", type=float, default=0)
    a = p.parse_args()
    return cmd_sample(a) if a.cmd == "sample" else cmd_draw(a)


if __name__ == "__main__":
    sys.exit(main())
