#!/usr/bin/env python3
"""Pools the steps of `hpmoe run --json` reports of one configuration.

A machine that stalls now and then (docs/simulation.md) makes single steps
1.4-2.2x slow, and a median of a few steps can land on them.
bench/validate_sim.sh therefore measures a configuration again, with as many
steps once more, whenever more than a third of the steps of one executor and
pass are slow (over a set ratio of that summary's fastest step), and pools
the two runs: every summary's samples are joined and its median, min and
max recomputed from them. The rule looks only at the measurements, never at
a prediction.

  bench/pool_runs.py slow RUN.json RATIO        the largest share of slow steps over the summaries
  bench/pool_runs.py pool OUT.json RUN.json...  the pooled report (OUT may be one of the inputs)
"""
import json
import os
import statistics
import sys
import tempfile

SUMMARIES = (("serialized", "dispatch_to_combine"), ("serialized", "backward"),
             ("interleaved", "dispatch_to_combine"), ("interleaved", "backward"))


def summaries(report):
    for executor, key in SUMMARIES:
        s = report.get(executor, {}).get(key)
        if s is not None:
            yield executor, key, s


def samples(report):
    found = [(executor, key, s["samples_s"]) for executor, key, s in summaries(report) if s.get("samples_s")]
    if not found:
        sys.exit(f"pool_runs: the report has no samples_s in {', '.join(e + '.' + k for e, k in SUMMARIES)}; "
                 "write it with a build whose `hpmoe run --json` records samples_s")
    return found


def slow_share(report, ratio):
    """The largest share, over the summaries, of steps slower than `ratio` times the summary's fastest."""
    return max(sum(1 for x in xs if x > ratio * min(xs)) / len(xs) for _, _, xs in samples(report))


def pool(reports):
    out = json.loads(json.dumps(reports[0]))
    for executor, key, s in summaries(out):
        samples = [x for r in reports for x in r[executor][key]["samples_s"]]
        s.update(samples_s=samples, median_s=statistics.median(samples), min_s=min(samples), max_s=max(samples))
    return out


def main(argv):
    if len(argv) == 3 and argv[0] == "slow":
        print(f"{slow_share(json.load(open(argv[1])), float(argv[2])):.4f}")
    elif len(argv) >= 3 and argv[0] == "pool":
        pooled = pool([json.load(open(p)) for p in argv[2:]])
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(argv[1])))
        with os.fdopen(fd, "w") as f:
            json.dump(pooled, f)
        os.replace(tmp, argv[1])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
