"""The few-row linear kernels over all of a GGUF file's layer weights, ms per pass (min and
median of --reps): fp32 few-row and fp32 panels on the dequantized weights, treadle's own int8,
and the file's own blocks (quantization="gguf"), each kernel in turn on the same inputs.

    .venv/bin/python benchmarks/weight_only.py [--rows 1,2,4,6] [--model FILE.gguf] [--only ffn_down]

The default model is the embedded SmolLM2 (Q4_1 layers). `--only` keeps the weights whose
GGUF name contains it. Time nothing else while it runs: the machine has two cores.
"""

from __future__ import annotations

import argparse
import statistics
import time

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from treadle.kernels.cpu import cpu_kernels_available
from treadle.models.gguf_weights import BLOCK_BYTES, GgufWeight
from treadle.models.linear import Int8Weight, pack_tiles
from treadle.models.loader import default_model_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,4,6")
    parser.add_argument("--model", default=None, help="a .gguf file (default: the embedded SmolLM2)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--only", default="", help="time only the weights whose GGUF name contains this")
    ns = parser.parse_args()
    if any(not 1 <= int(r) <= 8 for r in ns.rows.split(",")):
        parser.error("--rows: each in 1..8, the few-row kernels' range")
    if not cpu_kernels_available(torch.device("cpu")):
        raise SystemExit("treadle's CPU kernels did not build")
    weights = []   # (fp32, panels, int8, blocks) per layer weight the kernel reads directly
    for t in gguf.GGUFReader(ns.model or default_model_path()).tensors:
        if (t.name.startswith("blk.") and ns.only in t.name and len(t.shape) == 2
                and int(t.tensor_type) in BLOCK_BYTES):
            blocks = GgufWeight(torch.from_numpy(np.array(t.data, copy=True)), int(t.tensor_type))
            w = torch.from_numpy(dequantize(t.data, t.tensor_type).reshape(blocks.tensors[0].shape[0], -1).copy())
            weights.append((w, pack_tiles(w), Int8Weight.quantize(w.clone()), blocks))
    mb = sum(b.tensors[0].numel() for *_, b in weights) / 1e6
    types = sorted({GGMLQuantizationType(b.ggml_type).name for *_, b in weights})
    print(f"{len(weights)} weights ({', '.join(types)}), {mb:.1f} MB of blocks\n")
    kernels = {
        "fp32 few-row": lambda x, w, p, q, b: torch.ops.treadle.small_rows_linear(x, w, None),
        "fp32 panels": lambda x, w, p, q, b: torch.ops.treadle.tiles_linear(x, p, None) if p is not None else None,
        "int8": lambda x, w, p, q, b: q.linear(x, None),
        "GGUF blocks": lambda x, w, p, q, b: b.linear(x, None),
    }
    print("| rows | " + " | ".join(kernels) + " |\n" + "|---" * (len(kernels) + 1) + "|")
    with torch.inference_mode():
        for rows in (int(r) for r in ns.rows.split(",")):
            xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w, *_ in weights}
            times: dict[str, list[float]] = {name: [] for name in kernels}
            for _ in range(ns.reps + 1):   # the first round warms up
                for name, kernel in kernels.items():
                    start = time.perf_counter()
                    for w, p, q, b in weights:
                        kernel(xs[w.shape[1]], w, p, q, b)
                    times[name].append((time.perf_counter() - start) * 1e3)
            cells = [f"{min(v[1:]):.2f}/{statistics.median(v[1:]):.2f}" for v in times.values()]
            print(f"| {rows} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
