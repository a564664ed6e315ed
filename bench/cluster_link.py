#!/usr/bin/env python3
"""What one shaped TCP link of scripts/cluster.sh delivers, and what moving
the bytes costs each host's core: rank 1 sends BYTES to rank 0 over TCP,
both doing nothing else, and each reports the wall time and the busy time of
its own core (user + system + irq + softirq in /proc/stat) over the transfer.
Run through scripts/cluster.sh, which starts it on each host in place of
hpmoe (HPMOE=bench/cluster_link.py; it ignores hpmoe's arguments):

  HPMOE=bench/cluster_link.py scripts/cluster.sh --flop-per-byte 2112 -- --bytes 64000000

Prints one JSON line per rank. bench/cluster_sweep.sh uses it to set the
cluster model's link rate and its put copy / receive costs."""
import json
import os
import socket
import sys
import time

def core_busy_seconds(core):
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith(f"cpu{core} "):
                v = [int(x) for x in line.split()[1:]]
                # user nice system idle iowait irq softirq steal
                return (v[0] + v[1] + v[2] + v[5] + v[6]) / os.sysconf("SC_CLK_TCK")
    raise SystemExit(f"cluster_link: no cpu{core} in /proc/stat")

def main():
    args = sys.argv[1:]
    total = int(args[args.index("--bytes") + 1]) if "--bytes" in args else 64_000_000
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "-1"))
    if rank not in (0, 1):
        raise SystemExit("cluster_link: run it through scripts/cluster.sh with 2 hosts")
    core = sorted(os.sched_getaffinity(0))[0]
    port, chunk = 47123, 1 << 16
    if rank == 0:
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("198.18.0.1", port))
        srv.listen(1)
        conn, _ = srv.accept()
        buf = bytearray(chunk)
        got = conn.recv_into(buf)  # the clock starts at the first bytes
        t0, b0 = time.perf_counter(), core_busy_seconds(core)
        while got < total:
            n = conn.recv_into(buf)
            if n == 0:
                break
            got += n
        wall, busy = time.perf_counter() - t0, core_busy_seconds(core) - b0
        conn.sendall(b"k")
        side = "receiver"
    else:
        for _ in range(200):
            try:
                conn = socket.create_connection(("198.18.0.1", port))
                break
            except OSError:
                time.sleep(0.05)
        else:
            raise SystemExit("cluster_link: rank 0 never listened")
        data = bytes(chunk)
        t0, b0 = time.perf_counter(), core_busy_seconds(core)
        sent = 0
        while sent < total:
            conn.sendall(data)
            sent += chunk
        conn.recv(1)  # rank 0 has all of it
        wall, busy = time.perf_counter() - t0, core_busy_seconds(core) - b0
        got = sent
        side = "sender"
    print(json.dumps({"rank": rank, "side": side, "core": core, "bytes": got, "wall_s": wall, "busy_s": busy,
                      "goodput_bytes_per_s": got / wall, "bytes_per_busy_s": got / busy if busy > 0 else None}), flush=True)

main()
