"""Restores from ``s3://`` on the CPU engine, decoding the GET responses themselves
(``S3Reader.submit_owned_read``, the default) against copying each into a buffer of the decoder's.

Starts SeaweedFS (``tests/seaweed.py``) on 127.0.0.1, saves one trained state there with the
defaults of a ``CheckpointManager`` with a remote tier (compressed), then restores it ``--rounds``
times each way, alternating, in one process; the first restore of each way is checked bit for
bit. Prints medians in seconds. Uses internals: it sets ``S3Reader.owns_read_buffers`` to False
for the copying side.

    python3 experiments/s3_owned_reads_ab.py --width 1024 --depth 6 --rounds 9
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

import benchlib  # noqa: E402
from seaweed import create_bucket, seaweedfs  # noqa: E402

import gdsckpt  # noqa: E402
from gdsckpt.io.s3 import S3Reader  # noqa: E402
from gdsckpt.state import flatten  # noqa: E402


def main() -> None:
    if not hasattr(S3Reader, "owns_read_buffers"):
        raise SystemExit("this probe measures commit 7861ea1 (S3Reader.owns_read_buffers), reverted since: "
                         "check that commit out to run it")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    state = benchlib.build_state(args.width, args.depth, 3, "cpu")
    with tempfile.TemporaryDirectory() as directory, seaweedfs(Path(directory) / "weed") as endpoint:
        os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="ab", AWS_SECRET_ACCESS_KEY="ab",
                          AWS_REGION="us-east-1")
        create_bucket(endpoint, "owned-ab")
        url = "s3://owned-ab/state.gdsckpt"
        report = gdsckpt.save(state, url)
        flat = {a.key: a for a in flatten(state).arrays}
        times: dict[str, list[float]] = {"owned": [], "copied": []}
        for round_number in range(args.rounds):
            for way in times:
                S3Reader.owns_read_buffers = way == "owned"
                started = time.perf_counter()
                got = gdsckpt.load(url)
                times[way].append(time.perf_counter() - started)
                if round_number == 0:
                    restored = {a.key: a for a in flatten(got).arrays}
                    assert restored.keys() == flat.keys()
                    for key, array in flat.items():
                        if array.source is not None:
                            want = array.source.host_bytes(0, array.source.nbytes)
                            have = restored[key].source.host_bytes(0, restored[key].source.nbytes)
                            assert want.tobytes() == have.tobytes(), key
                del got
        S3Reader.owns_read_buffers = True
    logical = benchlib.logical_bytes(state)
    print(f"state {logical / 1e9:.3f} GB, file ratio {report.ratio:.3f}, {args.rounds} rounds each, "
          f"{os.cpu_count()} cores shared with the server")
    for way, values in times.items():
        median = statistics.median(values)
        print(f"  {way:7s} median {median:6.3f} s  {logical / median / 1e9:6.3f} GB/s"
              f"  ({', '.join(f'{v:.3f}' for v in sorted(values))})")


if __name__ == "__main__":
    main()
