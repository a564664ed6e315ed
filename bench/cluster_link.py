#!/usr/bin/env python3
"""What one shaped TCP link of scripts/cluster.sh delivers, and what moving
the bytes costs each host's core: rank 1 sends BYTES to rank 0 over TCP,
both doing nothing else, and each reports the wall time and the busy time of
its own core (user + system + irq + softirq in /proc/stat) over the transfer.
With --both, each rank sends BYTES to the other while receiving theirs, as
in an all-to-all: each reports the goodput it received at and its core's
busy time over the exchange. With --load, a meter process on each host's
core counts loop iterations throughout, as a worker computing while the
bytes move: what the transfer takes from it is the transfer's cost on a
busy core ("stolen_s"; an idle core's busy time also holds the cost of
waking from idle for each burst of packets, which a computing core does not
pay). Run through scripts/cluster.sh, which starts
it on each host in place of hpmoe (HPMOE=bench/cluster_link.py; it ignores
hpmoe's arguments):

  HPMOE=bench/cluster_link.py scripts/cluster.sh --flop-per-byte 2112 -- --bytes 64000000 [--both]

Prints one JSON line per rank. bench/cluster_sweep.sh uses it to set the
cluster model's link rate and its put copy / receive costs."""
import json
import multiprocessing
import os
import socket
import sys
import threading
import time

PORT, CHUNK = 47123, 1 << 16

def core_busy_seconds(core):
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith(f"cpu{core} "):
                v = [int(x) for x in line.split()[1:]]
                # user nice system idle iowait irq softirq steal
                return (v[0] + v[1] + v[2] + v[5] + v[6]) / os.sysconf("SC_CLK_TCK")
    raise SystemExit(f"cluster_link: no cpu{core} in /proc/stat")

class Meter:
    """A process on this core that counts loop iterations, as a stand-in for
    a computing worker: its rate alone, and the core time it lost since."""
    def __init__(self):
        self.count = multiprocessing.Value("q", 0, lock=False)
        self.proc = multiprocessing.Process(target=Meter.loop, args=(self.count,), daemon=True)
        self.proc.start()
        time.sleep(0.2)
        c0, t0 = self.count.value, time.perf_counter()
        time.sleep(1.0)
        self.rate = (self.count.value - c0) / (time.perf_counter() - t0)

    @staticmethod
    def loop(count):
        n = 0
        while True:
            for _ in range(10000):
                n += 1
            count.value = n

    def mark(self):
        return self.count.value, time.perf_counter()

    def stolen_since(self, mark):
        c0, t0 = mark
        wall = time.perf_counter() - t0
        return wall - (self.count.value - c0) / self.rate

    def stop(self):
        self.proc.terminate()
        self.proc.join()

def listen(rank):
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((f"198.18.0.{rank + 1}", PORT + rank))
    srv.listen(1)
    return srv

def connect(peer):
    for _ in range(200):
        try:
            return socket.create_connection((f"198.18.0.{peer + 1}", PORT + peer))
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"cluster_link: rank {peer} never listened")

def receive(conn, total, out):
    buf = bytearray(CHUNK)
    got = conn.recv_into(buf)  # the clock starts at the first bytes
    t0 = time.perf_counter()
    while got < total:
        n = conn.recv_into(buf)
        if n == 0:
            break
        got += n
    out["got"], out["wall"] = got, time.perf_counter() - t0
    conn.sendall(b"k")

def send(conn, total):
    data = bytes(CHUNK)
    sent = 0
    while sent < total:
        conn.sendall(data)
        sent += CHUNK
    conn.recv(1)  # the peer has all of it
    return sent

def main():
    args = sys.argv[1:]
    total = int(args[args.index("--bytes") + 1]) if "--bytes" in args else 64_000_000
    both = "--both" in args
    meter = Meter() if "--load" in args else None
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "-1"))
    if rank not in (0, 1):
        raise SystemExit("cluster_link: run it through scripts/cluster.sh with 2 hosts")
    core = sorted(os.sched_getaffinity(0))[0]
    peer = 1 - rank
    if both:
        srv = listen(rank)
        out = connect(peer)
        inc, _ = srv.accept()
        received = {}
        t = threading.Thread(target=receive, args=(inc, total, received))
        t0, b0 = time.perf_counter(), core_busy_seconds(core)
        m0 = meter.mark() if meter else None
        t.start()
        send(out, total)
        t.join()
        wall, busy = time.perf_counter() - t0, core_busy_seconds(core) - b0
        report(meter, m0, {"rank": rank, "side": "both", "core": core, "bytes": received["got"], "wall_s": wall,
                           "busy_s": busy, "goodput_bytes_per_s": received["got"] / received["wall"],
                           "bytes_per_busy_s": 2 * received["got"] / busy if busy > 0 else None}, 2 * received["got"])
        return
    if rank == 0:
        conn, _ = listen(0).accept()
        received = {}
        b0 = core_busy_seconds(core)
        m0 = meter.mark() if meter else None
        receive(conn, total, received)
        got, wall, busy = received["got"], received["wall"], core_busy_seconds(core) - b0
        side = "receiver"
    else:
        conn = connect(0)
        t0, b0 = time.perf_counter(), core_busy_seconds(core)
        m0 = meter.mark() if meter else None
        got = send(conn, total)
        wall, busy = time.perf_counter() - t0, core_busy_seconds(core) - b0
        side = "sender"
    report(meter, m0, {"rank": rank, "side": side, "core": core, "bytes": got, "wall_s": wall, "busy_s": busy,
                       "goodput_bytes_per_s": got / wall, "bytes_per_busy_s": got / busy if busy > 0 else None}, got)

def report(meter, mark, result, moved):
    if meter:  # the core time the transfer took from a computing process
        stolen = meter.stolen_since(mark)
        meter.stop()
        result["stolen_s"] = stolen
        result["bytes_per_stolen_s"] = moved / stolen if stolen > 0 else None
    print(json.dumps(result), flush=True)

main()
