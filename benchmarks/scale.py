"""The control plane at 64, 256 and 1,024 ranks, by simulation (issue 49, item 5).

``stratagem.testing.scale`` runs N simulated ranks in this process (a few driver threads, each
with its own client) against a real TCPStore: the real heartbeat and verdict code, every store
call counted through a proxy. For each N, ``--seconds`` without a fault (store calls a second,
calls a beat a rank, the beat's age at p99 as the watcher sees it, false failures), then four
faults one after another, each timed until every live rank names the right rank: a rank killed,
one stopped, one cut off from the store, and the watcher itself killed. The "before" rows replay
the protocol this replaced (every rank reading every peer's beat: 2N + 2 calls a beat, counted
8 / 32 a beat a rank at N = 4 / 16 with that code) for ``--before-seconds``, without faults: its
calls a second are what the store managed, and its age p99 is the time between one rank's beats
(above ``dead_after_seconds`` = 6 s its peers would take it for dead).

Run: ``python benchmarks/scale.py [--ranks 64 256 1024] [--seconds 60] [--before-seconds 10]``.
"""

from __future__ import annotations

import argparse

from stratagem.testing.scale import FAULTS, HEADER, simulate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="*", default=[64, 256, 1024])
    parser.add_argument("--seconds", type=float, default=60.0, help="fault-free time of each run")
    parser.add_argument("--before-seconds", type=float, default=10.0,
                        help="time of each run of the old all-to-all protocol (0: none)")
    parser.add_argument("--before-ranks", type=int, nargs="*", default=[64, 256],
                        help="N for the old protocol (its cost at 1,024 is 2.1M calls/s)")
    args = parser.parse_args()
    print(HEADER, flush=True)
    if args.before_seconds > 0:
        for n in args.before_ranks:
            print(simulate(n, seconds=args.before_seconds, faults=(), protocol="all-to-all").row(), flush=True)
    for n in args.ranks:
        r = simulate(n, seconds=args.seconds, faults=FAULTS)
        print(r.row(), flush=True)
        print(f"      {r.calls_per_second / n:.2f} calls/s a rank (budget 4); "
              f"{'OK' if r.calls_per_second < 4 * n and r.false_failures == 0 else 'OVER BUDGET'}", flush=True)


if __name__ == "__main__":
    main()
