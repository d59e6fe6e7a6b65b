"""Block-float conversion speed: MB of float32 input per second (best of N runs).

The figure issue 4 asks for is bfp8 encode of a 4096x4096 float32 tensor (64 MiB in). Also
printed: bfp4 encode, decode (MB of float32 out), the transposed decode (``decode_array_t``: a
package's matrix as the emulated GEMM holds it, what check and serving read per layer) and quantize
(encode + decode, what check's expected side does), and bf16 input (what safetensors checkpoints
hold; MB of bf16 in). The floor printed beside the decodes: widening one byte per value to float32
(``np.copyto``, one read and one write pass, no block-float arithmetic), which any decode costs.

Run: .venv/bin/python benches/bench_blockfloat.py [--rows 4096] [--cols 4096] [--repeat 3]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from ttbundle import blockfloat as bf


def best(fn, repeat: int) -> float:
    fn()  # warm-up (value tables, page faults)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    x = np.random.default_rng(0).standard_normal((args.rows, args.cols)).astype(np.float32)
    mb = x.nbytes / 1e6
    print(f"input: {args.rows}x{args.cols} float32 = {mb:.1f} MB; best of {args.repeat}")
    u8, out = np.zeros(x.shape, np.uint8), np.empty(x.shape, np.float32)
    floor = best(lambda: np.copyto(out, u8, casting="unsafe"), args.repeat)
    print(f"floor    {mb / floor:7.1f} MB/s   ({floor * 1e3:6.0f} ms: one byte per value widened to float32)")
    for fmt in ("bfp8", "bfp4"):
        data = bf.encode(x, fmt)
        enc = best(lambda: bf.encode(x, fmt), args.repeat)
        dec = best(lambda: bf.decode_array(data, x.shape, fmt), args.repeat)
        dec_t = best(lambda: bf.decode_array_t(data, x.shape, fmt), args.repeat)
        qua = best(lambda: bf.quantize_array(x, fmt), args.repeat)
        print(f"{fmt} encode   {mb / enc:7.1f} MB/s   ({enc * 1e3:6.0f} ms, {len(data) / 1e6:.1f} MB out)")
        print(f"{fmt} decode   {mb / dec:7.1f} MB/s   ({dec * 1e3:6.0f} ms)")
        print(f"{fmt} decode_t {mb / dec_t:7.1f} MB/s   ({dec_t * 1e3:6.0f} ms)")
        print(f"{fmt} quantize {mb / qua:7.1f} MB/s   ({qua * 1e3:6.0f} ms)")
    try:
        import torch
    except ImportError:
        return
    xb = torch.from_numpy(x).to(torch.bfloat16)
    enc = best(lambda: bf.encode(xb, "bfp8"), args.repeat)
    print(f"bfp8 encode from bf16 {x.nbytes / 2e6 / enc:7.1f} MB/s of bf16 in ({enc * 1e3:6.0f} ms)")


if __name__ == "__main__":
    main()
