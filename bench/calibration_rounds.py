#!/usr/bin/env python3
"""How a calibration's tile rounds spread: `hpmoe calibrate` measures every
tile shape in rounds and keeps each round's rate under "rounds"; this counts
the rounds that ran slow (under 0.6x their shape's fastest) and the rates a
median of the rounds would have set more than 20% under the second-fastest
round the model takes.

  bench/calibration_rounds.py MODEL.json
"""
import json
import statistics
import sys


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: calibration_rounds.py MODEL.json")
    model = json.load(open(sys.argv[1]))
    slow = total = low_median = rates = 0
    for shape in model["matrix"]["tile_rates"]:
        for key, rounds in shape.get("rounds", {}).items():
            slow += sum(x < 0.6 * max(rounds) for x in rounds)
            total += len(rounds)
            low_median += statistics.median(rounds) < 0.8 * shape[key]
            rates += 1
    if not total:
        sys.exit(f"{sys.argv[1]}: no 'rounds' in matrix.tile_rates (a model from an older hpmoe calibrate)")
    print(f"CPU: {model.get('peak', {}).get('cpu', '?')}")
    print(f"rounds under 0.6x their shape's fastest: {slow} of {total} ({slow / total * 100:.1f}%)")
    print(f"rates a median of the rounds would set under 0.8x the second-fastest: {low_median} of {rates}")


if __name__ == "__main__":
    main()
