#!/usr/bin/env python3
"""Transparent huge pages for hpmoe's buffers, measured: one layer run with
glibc's malloc as it is and with glibc.malloc.hugetlb=1 (malloc asks the
kernel for huge pages, madvise mode), alternating, twice each. Prints per run
the page faults, user and system seconds and wall time of the whole process
(setup included), and every measured step's forward and backward times (ms).

  bench/thp_setup.py ITERATIONS      (from the repository root, build/hpmoe built)

docs/results/benchmarks.md, "Huge pages": setup faults 8.5x fewer, steps slower on
the virtual machine measured, so not adopted.
"""
import json
import os
import resource
import subprocess
import sys
import tempfile
import time


def run(iters, env, report):
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.time()
    subprocess.run(["build/hpmoe", "run", "--preset", "deepseek-v2-lite", "-P", "1", "-W", "2", "-T", "256",
                    "--routing", "uniform", "--backward", "--iters", str(iters), "--warmup", "1", "--verify", "off",
                    "--json", report], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, env=env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    j = json.load(open(report))
    ms = lambda executor, key: [round(x * 1e3) for x in j[executor][key]["samples_s"]]
    return dict(minflt=after.ru_minflt - before.ru_minflt, user=round(after.ru_utime - before.ru_utime, 1),
                sys=round(after.ru_stime - before.ru_stime, 1), wall=round(time.time() - start, 1),
                ser=ms("serialized", "dispatch_to_combine"), inter=ms("interleaved", "dispatch_to_combine"),
                serb=ms("serialized", "backward"), interb=ms("interleaved", "backward"))


if len(sys.argv) != 2:
    sys.exit(__doc__)
plain = dict(os.environ)
huge = dict(os.environ, GLIBC_TUNABLES="glibc.malloc.hugetlb=1")
with tempfile.TemporaryDirectory() as tmp:
    for name, env in (("plain", plain), ("hugetlb=1", huge), ("plain", plain), ("hugetlb=1", huge)):
        print(name, run(int(sys.argv[1]), env, os.path.join(tmp, "run.json")), flush=True)
