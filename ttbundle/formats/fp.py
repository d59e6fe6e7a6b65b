"""Floating-point quantized formats: OCP MXFP4 (GPT-OSS's experts) and FP8 e4m3 with a scale per
tensor, per output channel, per group of inputs or per block (DeepSeek's ``weight_scale_inv``,
compressed-tensors' ``weight_scale``)."""

from __future__ import annotations

from functools import lru_cache

from ..errors import InvalidInput
from ..tiles import cdiv
from .base import Entry, Scheme, View, bad_shape, companions, unsupported

FP8 = frozenset({"F8_E4M3", "F8_E5M2"})

#: rows of one matrix decoded at a time (bounded float32 scratch on a large matrix)
ROWS = 1024
#: rows of an MXFP4 matrix looked up and transposed at a time (the band's bf16 stays in cache)
BAND = 256

FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_dequant(blocks, scales):
    """OCP MXFP4: ``blocks`` [..., N, G, 16] uint8, two e2m1 values per byte (low nibble first),
    ``scales`` [..., N, G] uint8 e8m0 exponents (bias 127), one per 32 values -> float32
    [..., N, G*32]."""
    import torch

    lut = torch.tensor(FP4_E2M1, dtype=torch.float32)
    b = blocks.to(torch.uint8).long()
    v = torch.stack((lut[b & 0x0F], lut[b >> 4]), dim=-1).flatten(-2)  # [..., N, G, 32]
    v = v * torch.exp2(scales.to(torch.int32).float() - 127).unsqueeze(-1)
    return v.flatten(-2)


@lru_cache(maxsize=1)
def _mxfp4_table():
    """``[256 * 256]`` int32: for ``scale << 8 | byte``, the byte's two values (low nibble first) as
    :func:`mxfp4_dequant` gives them, rounded to bf16, packed as two bf16 bit patterns: the table is
    :func:`mxfp4_dequant` of every (scale, byte) pair, so the format has one definition."""
    import torch

    byte = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(1, 16, 1, 16).expand(256, 16, 1, 16)
    scale = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(256, 1, 1).expand(256, 16, 1)
    v = mxfp4_dequant(byte, scale).to(torch.bfloat16)  # [256 scales, 16, 32]: byte 16 r + j -> 2j, 2j+1
    return v.reshape(256, 256, 2).contiguous().view(torch.int32).reshape(-1)


@lru_cache(maxsize=8)
def _byte_table(dtype):
    """``[256]`` float32: the value of each bit pattern of a one-byte ``dtype`` (fp8 e4m3 / e5m2,
    int8, uint8) as torch converts it (the table is torch's own conversion of every byte)."""
    import torch

    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()


def one_byte(dtype) -> bool:
    """Whether ``dtype`` is a one-byte number format :func:`byte_values` decodes by table."""
    import torch

    return dtype.itemsize == 1 and dtype != torch.bool


def byte_values(t, out=None, index=None):
    """``t.float()`` for a contiguous tensor of a one-byte dtype, bit for bit, by one table lookup
    per byte (:func:`_byte_table`): torch's ``float8 -> float32`` conversion runs at ~190 M values/s
    on one thread here, the lookup several times that. ``out`` (float32) and ``index`` (int32), of
    at least ``t.numel()`` elements, are reused scratch (a loop over chunks then allocates, and
    page-faults, nothing per chunk). Other dtypes: ``t.float()``."""
    import torch

    if not one_byte(t.dtype) or not t.is_contiguous() or t.device.type != "cpu":
        return t.float()
    n = t.numel()
    idx = torch.empty(n, dtype=torch.int32) if index is None else index.view(-1)[:n]
    idx.copy_(t.view(torch.uint8).reshape(-1))
    res = torch.empty(n, dtype=torch.float32) if out is None else out.view(-1)[:n]
    torch.index_select(_byte_table(t.dtype), 0, idx, out=res)
    return res.view(t.shape)


def mxfp4_dense(blocks, scales):
    """The dense tensor of an MXFP4 pair in transformers' layout (``convert_moe_packed_tensors``):
    [..., G*32, N] bf16, one leading index (expert) and a band of ``BAND`` rows at a time: one
    lookup per byte in :func:`_mxfp4_table` (the bf16 pair of the byte under its block's scale),
    then the band written transposed (the values :func:`mxfp4_dequant` gives, ~9x faster)."""
    import torch

    *lead, N, G, _ = blocks.shape
    out = torch.empty(*lead, G * 32, N, dtype=torch.bfloat16)
    flat_o, flat_b, flat_s = out.reshape(-1, G * 32, N), blocks.reshape(-1, N, G, 16), scales.reshape(-1, N, G)
    table = _mxfp4_table()
    for e in range(flat_o.shape[0]):
        for n0 in range(0, N, BAND):
            n1 = min(N, n0 + BAND)
            idx = flat_b[e, n0:n1].to(torch.int32)
            idx |= flat_s[e, n0:n1].to(torch.int32).unsqueeze(-1) << 8
            v = table.index_select(0, idx.reshape(-1)).view(torch.bfloat16).reshape(n1 - n0, G * 32)
            flat_o[e, :, n0:n1].copy_(v.T)
    return out


class Mxfp4(Scheme):
    """``P_blocks`` + ``P_scales`` -> ``P`` (GPT-OSS: ``experts.gate_up_proj`` [E, H, 2I],
    ``experts.down_proj`` [E, I, H], as a bf16 GPT-OSS checkpoint stores them)."""

    name = "mxfp4"

    def view(self, stored, where):
        v = View(self.name)
        for p, (kb, ks) in companions(stored, ("_blocks", "_scales")).items():
            (db, sb), (ds, ss) = stored[kb], stored[ks] if ks else (None, None)
            if ks is None:
                raise InvalidInput(f"{where}: {kb} has no {p}_scales (MXFP4 stores one e8m0 scale per 32 values)")
            if db != "U8" or ds != "U8" or len(sb) < 3 or sb[-1] != 16 or tuple(ss) != tuple(sb[:-1]):
                raise bad_shape(where, kb, sb, f"MXFP4 needs uint8 blocks [..., N, G, 16] and uint8 scales "
                                f"[..., N, G] ({ks}: {ds} {list(ss)})")
            shape = tuple(sb[:-3]) + (sb[-2] * 32, sb[-3])
            v.decoded[p] = Entry((kb, ks), lambda t: mxfp4_dense(*t), shape, self.name)
        return v


def scale_rule(scale_shape, out: int, inp: int, block=None):
    """How a scale of ``scale_shape`` covers a matrix [out, in] (each leading dim matched):
    ``(rows per scale, columns per scale)``, or None when it cannot. One value: the tensor;
    ``block`` (bm, bn): [ceil(out/bm), ceil(in/bn)]; [out, in/g] or [out, 1]: groups of g inputs
    (a channel: g = in)."""
    s = tuple(scale_shape)
    if len(s) == 0 or (len(s) == 1 and s[0] == 1) or (len(s) >= 2 and all(x == 1 for x in s)):
        return out, inp
    if len(s) < 2:
        return None
    r, c = s[-2], s[-1]
    if block is not None and (r, c) == (cdiv(out, block[0]), cdiv(inp, block[1])):
        return tuple(block)
    if r == out and c >= 1 and inp % c == 0:
        return 1, inp // c
    return None


def dequant_scaled(w, s, rows: int, cols: int, zero=None, g_idx=None):
    """``(w - zero) * s`` for a matrix stack ``w`` [..., out, in] (fp8 or integers) whose scale
    ``s`` (and zero point) holds one value per ``rows`` x ``cols`` block (:func:`scale_rule`), or
    per (row, g_idx[column]) with ``g_idx``; float32 math, ``ROWS`` rows at a time, bf16 out."""
    import torch

    *lead, out, inp = w.shape
    res = torch.empty(*lead, out, inp, dtype=torch.bfloat16)
    wf, rf = w.reshape(-1, out, inp), res.reshape(-1, out, inp)
    sf = s.float().reshape(-1, *s.shape[-2:]) if s.dim() >= 2 else s.float().reshape(1, 1, 1)
    zf = None if zero is None else zero.float().reshape(-1, *zero.shape[-2:])
    # a multiple of rows (a chunk starts on a scale's row block), or any size under one row block
    step = max(rows, ROWS // rows * rows) if rows < out else ROWS
    scratch = None
    if one_byte(w.dtype):  # one float32 and one index buffer for every chunk
        n = min(step, out) * inp
        scratch = {"out": torch.empty(n, dtype=torch.float32), "index": torch.empty(n, dtype=torch.int32)}
    for e in range(wf.shape[0]):
        se = sf[e if sf.shape[0] > 1 else 0]
        ze = None if zf is None else zf[e if zf.shape[0] > 1 else 0]
        for r0 in range(0, out, step):
            r1 = min(out, r0 + step)
            x = byte_values(wf[e, r0:r1], **(scratch or {}))
            if ze is None and g_idx is None and se.numel() > 1 and (r1 - r0) % rows == 0 and inp % cols == 0:
                # whole blocks: the scale broadcast over each block, no expanded copy of it
                xb = x.view((r1 - r0) // rows, rows, inp // cols, cols)
                xb *= se[r0 // rows:r1 // rows].reshape((r1 - r0) // rows, 1, inp // cols, 1)
                rf[e, r0:r1] = x
                continue

            def expand(t):
                if t.numel() == 1:
                    return t.reshape(1, 1)
                if g_idx is not None:
                    return t[r0:r1][:, g_idx.long()]
                # r0 is a multiple of rows, or under rows (step)
                t = t[r0 // rows:cdiv(r1, rows)].repeat_interleave(rows, 0)[:r1 - r0]
                return t.repeat_interleave(cols, 1)[:, :inp]
            if ze is not None:
                x -= expand(ze)
            rf[e, r0:r1] = x * expand(se)
    return res


class Fp8(Scheme):
    """FP8 Linear weights: ``P.weight`` (e4m3) with ``P.weight_scale_inv`` (blocks of
    ``weight_block_size``: DeepSeek) or ``P.weight_scale`` (per tensor or channel), for any
    family; ``P.input_scale`` (static activation scales) is dropped."""

    name = "fp8"

    def __init__(self, block=None, name: str = "fp8"):
        self.block, self.name = block, name

    @classmethod
    def from_config(cls, qc: dict, where: str):
        fmt = str(qc.get("fmt", "e4m3")).lower()
        if fmt not in ("e4m3", "float8_e4m3fn", "e5m2", "float8_e5m2"):
            raise unsupported(where, f"fmt={qc.get('fmt')!r} (fp8)")
        b = qc.get("weight_block_size")
        if b is not None and (not isinstance(b, (list, tuple)) or len(b) != 2 or
                              not all(isinstance(x, int) and x > 0 for x in b)):
            raise InvalidInput(f"{where}: quantization_config.weight_block_size={b!r}: expected [rows, columns] "
                               "of one scale's block, e.g. [128, 128]")
        return cls(tuple(b) if b else None, f"fp8 {'block ' + 'x'.join(map(str, b)) if b else 'per-tensor'}")

    def view(self, stored, where):
        v = View(self.name)
        fp8_view(v, stored, where, self.block, ("weight_scale_inv", "weight_scale"))
        return v


def fp8_view(v: View, stored: dict, where: str, block, scale_names) -> None:
    """Every fp8 ``P.weight`` of ``stored`` decoded with its scale (the first of ``scale_names``
    present) into ``v``; activation scales dropped."""
    for k, (dt, shape) in stored.items():
        if k.endswith((".input_scale", ".input_zero_point")):
            v.dropped.add(k)
        if dt not in FP8:
            continue
        p = k[:-len("weight")] if k.endswith("weight") else None
        sk = next((p + n for n in scale_names if p is not None and p + n in stored), None)
        if sk is None:
            raise InvalidInput(f"{where}: {k} is fp8 ({dt}) with no {' or '.join(p + n for n in scale_names)} "
                               "beside it: the checkpoint misses its scales")
        if len(shape) < 2:
            raise bad_shape(where, k, shape, "an fp8 weight is a matrix [out, in]")
        rule = scale_rule(stored[sk][1], shape[-2], shape[-1], block)
        if rule is None:
            bs = f" for weight_block_size {list(block)}" if block else ""
            raise bad_shape(where, sk, stored[sk][1], f"it does not cover {k} {list(shape)}{bs} (expected one value, "
                            f"[out, 1], [out, in/group]" + (f" or [{cdiv(shape[-2], block[0])}, "
                                                              f"{cdiv(shape[-1], block[1])}]" if block else "") + ")")
        v.decoded[k] = Entry((k, sk), lambda t, r=rule: dequant_scaled(t[0], t[1], *r), tuple(shape), v.scheme)
