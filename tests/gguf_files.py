"""GGUF files for the tests: K-quant blocks made from real weights, and a copy of a GGUF with
some tensors swapped for other blocks.

gguf's Python package reads every type but writes none of the K-quants, so Q4_K and Q6_K are
made here, by plain rounding (llama.cpp searches for better scales; a test needs only valid
blocks close to the weights). The layouts are those gguf.quants decodes; a test checks the
round trip.
"""

from __future__ import annotations

import gguf
import numpy as np


def _safe(x: np.ndarray) -> np.ndarray:
    return np.where(x == 0, 1, x)


def quantize_q6_k(weight: np.ndarray) -> np.ndarray:
    """[rows, cols] fp32 (cols a multiple of 256) -> Q6_K blocks, uint8 [rows, cols / 256 * 210]."""
    rows = weight.shape[0]
    w = weight.reshape(-1, 256).astype(np.float32)
    n = w.shape[0]
    groups = w.reshape(n, 16, 16)
    scale = np.abs(groups).max(-1) / 31
    d = (scale.max(-1) / 127).astype(np.float16)
    sc = np.clip(np.round(scale / _safe(d.astype(np.float32))[:, None]), -128, 127).astype(np.int8)
    step = d.astype(np.float32)[:, None] * sc
    q = np.clip(np.round(groups / _safe(step)[..., None]) + 32, 0, 63).astype(np.uint8).reshape(n, 8, 32)
    low, high = np.zeros((n, 128), np.uint8), np.zeros((n, 64), np.uint8)
    for g in range(8):   # sub-block g = 4 h + t of 32 weights
        h, t = divmod(g, 4)
        at = h * 64 + (t & 1) * 32
        low[:, at:at + 32] |= (q[:, g] & 0xF) << ((t >> 1) * 4)
        high[:, h * 32:h * 32 + 32] |= (q[:, g] >> 4) << (2 * t)
    blocks = np.concatenate([low, high, sc.view(np.uint8), d.view(np.uint8).reshape(n, 2)], axis=1)
    return blocks.reshape(rows, -1)


def quantize_q4_k(weight: np.ndarray) -> np.ndarray:
    """[rows, cols] fp32 (cols a multiple of 256) -> Q4_K blocks, uint8 [rows, cols / 256 * 144]."""
    rows = weight.shape[0]
    w = weight.reshape(-1, 256).astype(np.float32)
    n = w.shape[0]
    groups = w.reshape(n, 8, 32)
    lowest = np.minimum(groups.min(-1), 0)
    scale, offset = (groups.max(-1) - lowest) / 15, -lowest
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (offset.max(-1) / 63).astype(np.float16)
    sc = np.clip(np.round(scale / _safe(d.astype(np.float32))[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(offset / _safe(dmin.astype(np.float32))[:, None]), 0, 63).astype(np.uint8)
    step, shift = d.astype(np.float32)[:, None] * sc, dmin.astype(np.float32)[:, None] * mn
    q = np.clip(np.round((groups + shift[..., None]) / _safe(step)[..., None]), 0, 15).astype(np.uint8)
    packed = np.zeros((n, 12), np.uint8)   # six-bit scales and mins; the top two bits of 4..7 ride in 0..7
    packed[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)
    nibbles = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(n, 128)
    blocks = np.concatenate([d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), packed, nibbles],
                            axis=1)
    return blocks.reshape(rows, -1)


QUANTIZERS = {gguf.GGMLQuantizationType.Q4_K: quantize_q4_k, gguf.GGMLQuantizationType.Q6_K: quantize_q6_k}


def write_with(src: str, dst: str, replace: dict[str, gguf.GGMLQuantizationType]) -> None:
    """A copy of the GGUF at `src` with each named tensor re-encoded in the given K type (from
    its dequantized values); metadata and every other tensor as they were."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue   # the writer adds these itself
        kind = field.types[0]
        writer.add_key_value(field.name, field.contents(), kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    tensors = []
    for t in reader.tensors:
        if t.name in replace:
            weight = gguf.quants.dequantize(t.data, t.tensor_type)
            tensors.append((t.name, replace[t.name], QUANTIZERS[replace[t.name]](weight)))
        else:
            tensors.append((t.name, t.tensor_type, t.data))
    for name, kind, data in tensors:
        writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, _, data in tensors:
        writer.write_tensor_data(data)
    writer.close()
