"""Where a GPU restore's device memory goes beyond its staging budget: one 2 GiB state (the GPU
memory test's: bf16 and fp32 halves) saved with ``--codec`` on the GPU engine, then restored
into new CUDA tensors under ``restore_staging_bytes=--budget``, with and without the lead read
(``gdsckpt.api.resolve.LEAD_READS``), alternating. Per restore: the device-wide peak beyond the
restored tensors (``cudaMemGetInfo`` sampled every millisecond, as ``tests/gpu/test_gpu_memory.py``
measures it), CuPy's pool (total and in use) at its peak and right after the decoder reserved its
ring, the ring's slots and arena pieces, the largest decode batch, and whether it was bit-exact.

    python3 experiments/restore_memory_probe.py --codec zstd --budget 512MiB --save-budget 1536MiB

Uses internals: patches ``pipeline.gpu.decoder.GpuDecoder.reserve_reads`` and ``_decode_batch`` to
record, and toggles ``api.resolve.LEAD_READS``.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "gpu"))


def main() -> None:
    import cupy
    import torch

    import gdsckpt
    from gdsckpt.api import resolve
    from gdsckpt.config import parse_size
    from gdsckpt.demo import bit_equal
    from gdsckpt.pipeline.gpu import decoder as decoder_module

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--codec", default="zstd")
    parser.add_argument("--budget", default="512MiB", help="restore_staging_bytes")
    parser.add_argument("--save-budget", default="1536MiB", help="max_staging_bytes of the save")
    parser.add_argument("--rounds", type=int, default=2, help="restores per way")
    parser.add_argument("--path", default="/tmp/restore-memory-probe.gdsckpt")
    args = parser.parse_args()

    import test_gpu_memory as memory_test  # the test's state and its device-wide sampler

    state = memory_test._big_state()
    config = gdsckpt.Config(max_staging_bytes=parse_size(args.save_budget),
                            restore_staging_bytes=parse_size(args.budget), engine="gpu")
    gdsckpt.save(state, args.path, codec=args.codec, config=config)
    pool = cupy.get_default_memory_pool()
    seen: dict = {}
    reserve, decode_batch = decoder_module.GpuDecoder.reserve_reads, decoder_module.GpuDecoder._decode_batch

    def recorded_reserve(self, *a, **k):  # type: ignore[no-untyped-def]
        slots = reserve(self, *a, **k)
        seen.update(slots=slots, arena_pieces=self.arena.pieces if self.arena else 0,
                    lead_adopted=bool(self.arena and self.arena.lead), staging_mib=self.staging_bytes >> 20,
                    pool_total_at_reserve_mib=pool.total_bytes() >> 20, pool_used_at_reserve_mib=pool.used_bytes() >> 20)
        return slots

    def recorded_batch(self, jobs):  # type: ignore[no-untyped-def]
        seen["largest_batch"] = max(seen.get("largest_batch", 0), len(jobs))
        return decode_batch(self, jobs)

    decoder_module.GpuDecoder.reserve_reads = recorded_reserve
    decoder_module.GpuDecoder._decode_batch = recorded_batch
    for _round in range(args.rounds):
        for lead in (True, False):
            resolve.LEAD_READS = lead
            seen.clear()
            pool_peak = [0, 0]
            stop = threading.Event()

            def sample(peak: list[int] = pool_peak, done: threading.Event = stop) -> None:
                while not done.wait(0.001):
                    peak[0] = max(peak[0], pool.total_bytes())
                    peak[1] = max(peak[1], pool.used_bytes())
            sampler = threading.Thread(target=sample, daemon=True)
            with memory_test._Peak() as peak:
                sampler.start()
                loaded = gdsckpt.load(args.path, device="cuda", config=config)
                stop.set()
                sampler.join()
            exact = all(bit_equal(state[k], loaded[k]) for k in state)
            del loaded
            torch.cuda.empty_cache()
            print(f"lead read {'on ' if lead else 'off'}: beyond the tensors {(peak.gpu - peak.torch_growth) >> 20} MiB "
                  f"(budget {parse_size(args.budget) >> 20} MiB), pool peak total {pool_peak[0] >> 20} / used "
                  f"{pool_peak[1] >> 20} MiB, {seen}, bit-exact {exact}", flush=True)
    os.remove(args.path)


if __name__ == "__main__":
    main()
