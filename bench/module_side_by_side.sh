#!/usr/bin/env bash
# hpmoe.MoELayer's per-call cost (bench/module_overhead.py) for two builds of
# the Python module, run alternately, with and without a weight update between
# calls: a markdown table of the medians over the rounds, with their range.
#   bench/module_side_by_side.sh OLD_BUILD/python NEW_BUILD/python [ROUNDS]
set -euo pipefail
old=${1:?old build/python}; new=${2:?new build/python}; rounds=${3:-5}
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
for ((i = 0; i < rounds; ++i)); do
  for update in "" --update; do
    for which in old new; do
      dir=$old; [ "$which" = new ] && dir=$new
      PYTHONPATH=$dir /usr/bin/python3 "$here/module_overhead.py" --calls 20 $update >> "$tmp/$which.jsonl"
    done
  done
done
python3 - "$tmp" <<'PY'
import json, statistics, sys
rows = {}
for which in ("old", "new"):
    for line in open(f"{sys.argv[1]}/{which}.jsonl"):
        r = json.loads(line)
        rows.setdefault((r["update"], which), []).append(r["median_ms"])
print("| weights between calls | old ms (median, range) | new ms (median, range) | new / old |")
print("|---|---|---|---|")
for update in (False, True):
    o, n = rows[(update, "old")], rows[(update, "new")]
    print(f"| {'changed (SGD step)' if update else 'unchanged'} | {statistics.median(o):.1f} ({min(o):.1f}-{max(o):.1f}) | "
          f"{statistics.median(n):.1f} ({min(n):.1f}-{max(n):.1f}) | {statistics.median(n) / statistics.median(o):.2f} |")
PY
