"""TFRecord read throughput with checksums on, against reading the same bytes raw.

Writes one TFRecord file (in the page cache after writing and a warm-up read), then alternates
REPEATS times: raw ``f.read`` of the whole file in 1 MiB chunks (the disk-speed bound),
``TFRecordDataset(verify_checksums=True)`` and ``verify_checksums=False``. Prints MB/s medians
and the ratio against raw. Also prints the pure-Python CRC-32C rate it replaced.

Run: .venv/bin/python benchmarks/tfrecord_read.py [--mb 256] [--record-kb 100]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from stratagem.data import TFRecordDataset, TFRecordWriter
from stratagem.data import checksum as crc

REPEATS = 5


def raw_read(path: str) -> int:
    total = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            total += len(chunk)
    return total


def records(path: str, verify: bool) -> int:
    return sum(len(r) for r in TFRecordDataset(path, verify_checksums=verify))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mb", type=int, default=256, help="file size in MB")
    parser.add_argument("--record-kb", type=float, default=100.0, help="record size in KB")
    args = parser.parse_args()
    size = int(args.record_kb * 1000)
    n = max(1, args.mb * 1_000_000 // size)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "data.tfrecord")
        payload = os.urandom(size)
        with TFRecordWriter(path) as w:
            for i in range(n):
                w.write(payload[i % 97:] + payload[: i % 97])
        file_mb = os.path.getsize(path) / 1e6
        raw_read(path)  # warm the page cache
        rates: dict[str, list[float]] = {"raw read": [], "checksums on": [], "checksums off": []}
        for _ in range(REPEATS):
            for name, fn in (("raw read", lambda: raw_read(path)),
                             ("checksums on", lambda: records(path, True)),
                             ("checksums off", lambda: records(path, False))):
                t = time.perf_counter()
                fn()
                rates[name].append(file_mb / (time.perf_counter() - t))
    sample = os.urandom(1 << 18)
    t = time.perf_counter()
    crc.crc32c_python(sample)
    py_rate = len(sample) / 1e6 / (time.perf_counter() - t)
    raw = statistics.median(rates["raw read"])
    print(f"{n} records of {size / 1000:g} KB ({file_mb:.0f} MB, page cache); CRC-32C native: "
          f"{crc.NATIVE}; medians of {REPEATS} alternated runs")
    print(f"{'':<16}{'MB/s':>9}{'vs raw read':>13}")
    for name, values in rates.items():
        m = statistics.median(values)
        print(f"{name:<16}{m:>9.0f}{m / raw:>12.2f}x")
    print(f"(pure-Python CRC-32C, the previous implementation: {py_rate:.1f} MB/s)")


if __name__ == "__main__":
    main()
