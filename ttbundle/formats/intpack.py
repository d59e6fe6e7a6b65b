"""Integer weight-only formats and compressed-tensors: AWQ (AutoAWQ's GEMM packing), GPTQ
(AutoGPTQ / GPTQModel, with or without act-order ``g_idx``) and compressed-tensors
(``pack-quantized`` / ``int-quantized`` / ``naive-quantized`` integers, ``float-quantized`` fp8).
Layouts as vLLM reads them (``vllm/model_executor/layers/quantization/{awq,gptq,
compressed_tensors}``; the packers in ``utils/quant_utils``: ``awq_pack``, ``gptq_pack``) and as
``compressed_tensors.compressors`` writes them."""

from __future__ import annotations

from ..errors import InvalidInput
from ..tiles import cdiv
from .base import Entry, Scheme, View, bad_shape, companions, unsupported
from .fp import dequant_scaled, fp8_view, scale_rule

#: AutoAWQ's order of a word's 8 nibbles: nibble i holds column AWQ_ORDER[i] of its 8
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_int32(x, bits: int, dim: int, order=None):
    """Unsigned ``bits``-wide values packed low bits first into int32 words along ``dim`` (0:
    rows, 1: columns) -> int32 [..] with that dim ``32 // bits`` times longer. ``order``: the
    value each nibble of a word holds (AWQ's interleave), default sequential."""
    import torch

    pf, mask = 32 // bits, (1 << bits) - 1
    x = x.to(torch.int32)
    parts = [(x >> (bits * i)) & mask for i in range(pf)]
    if order is not None:
        inv = [0] * pf
        for i, o in enumerate(order):
            inv[o] = i
        parts = [parts[inv[j]] for j in range(pf)]
    out = torch.stack(parts, dim=dim + 1)  # [.., n, pf, ..]: word n's values in order
    shape = list(x.shape)
    shape[dim] *= pf
    return out.reshape(shape)


def _need(stored, where, key, dtype, shape):
    dt, sh = stored[key]
    if dtype is not None and dt not in dtype:
        raise InvalidInput(f"{where}: {key} is {dt}; expected {' or '.join(sorted(dtype))}")
    if shape is not None and tuple(sh) != tuple(shape):
        raise bad_shape(where, key, sh, f"expected {list(shape)}")
    return sh


def _groups_of(qc: dict, where: str) -> int:
    g = qc.get("group_size", qc.get("q_group_size", -1))
    if not isinstance(g, int) or (g <= 0 and g != -1):
        raise InvalidInput(f"{where}: quantization_config.group_size={g!r}: a positive integer or -1 (per channel)")
    return g


class Awq(Scheme):
    """AutoAWQ GEMM: ``P.qweight`` int32 [in, out/8] (8 nibbles per word in ``AWQ_ORDER``),
    ``P.qzeros`` int32 [in/g, out/8] (the same packing), ``P.scales`` [in/g, out] ->
    ``P.weight`` [out, in] = (q - z) * s."""

    name = "awq"

    def __init__(self, bits: int, group: int):
        self.bits, self.group = bits, group
        self.name = f"awq int{bits} group {group}"

    @classmethod
    def from_config(cls, qc, where):
        bits = qc.get("w_bit", qc.get("bits", 4))
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise unsupported(where, f"version={qc.get('version')!r} (awq: GEMM packing only)")
        if bits != 4:
            raise unsupported(where, f"w_bit={bits!r} (awq: 4-bit only, as vLLM)")
        if qc.get("zero_point", True) is not True:
            raise unsupported(where, "zero_point=false (awq: with zero points only, as AutoAWQ's GEMM)")
        return cls(bits, _groups_of(qc, where))

    def view(self, stored, where):
        v = View(self.name)
        pf = 32 // self.bits
        for p, (kq, kz, ks) in companions(stored, ("qweight", "qzeros", "scales")).items():
            if kz is None or ks is None:
                raise InvalidInput(f"{where}: {kq} has no {p}qzeros / {p}scales beside it (AWQ stores all three)")
            inp, po = _need(stored, where, kq, {"I32"}, None)[-2:]
            out = po * pf
            g = inp if self.group == -1 else self.group
            G = cdiv(inp, g)
            _need(stored, where, kz, {"I32"}, (G, po))
            _need(stored, where, ks, {"F16", "BF16", "F32"}, (G, out))

            def dec(t, bits=self.bits, g=g):
                q = unpack_int32(t[0], bits, 1, AWQ_ORDER)  # [in, out]
                z = unpack_int32(t[1], bits, 1, AWQ_ORDER)  # [G, out]
                return dequant_scaled(q.t(), t[2].t(), 1, g, zero=z.t())
            v.decoded[p + "weight"] = Entry((kq, kz, ks), dec, (out, inp), self.name)
        return v


class Gptq(Scheme):
    """GPTQ: ``P.qweight`` int32 [in*bits/32, out] (values packed down the input rows),
    ``P.qzeros`` int32 [G, out*bits/32] (packed along columns), ``P.scales`` [G, out], ``P.g_idx``
    [in] (each input row's group; act-order permutes it) -> ``P.weight`` [out, in] =
    (q - z') * s[g_idx], z' = the stored zero + 1 (the ``gptq`` checkpoint format; ``gptq_v2``
    stores z' itself)."""

    def __init__(self, bits: int, group: int, offset: int, desc_act: bool):
        self.bits, self.group, self.offset, self.desc_act = bits, group, offset, desc_act
        self.name = f"gptq int{bits} group {group}{' act-order' if desc_act else ''}"

    @classmethod
    def from_config(cls, qc, where):
        bits = qc.get("bits", 4)
        if bits not in (2, 4, 8):
            raise unsupported(where, f"bits={bits!r} (gptq: 2, 4 or 8)")
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise unsupported(where, f"checkpoint_format={qc.get('checkpoint_format')!r} (gptq: gptq or gptq_v2)")
        return cls(bits, _groups_of(qc, where), 1 if fmt == "gptq" else 0, bool(qc.get("desc_act", False)))

    def view(self, stored, where):
        v = View(self.name)
        pf = 32 // self.bits
        for p, (kq, kz, ks, kg) in companions(stored, ("qweight", "qzeros", "scales", "g_idx")).items():
            if kz is None or ks is None:
                raise InvalidInput(f"{where}: {kq} has no {p}qzeros / {p}scales beside it (GPTQ stores both)")
            pi, out = _need(stored, where, kq, {"I32"}, None)[-2:]
            inp = pi * pf
            g = inp if self.group == -1 else self.group
            G = cdiv(inp, g)
            _need(stored, where, kz, {"I32"}, (G, cdiv(out, pf)))
            _need(stored, where, ks, {"F16", "BF16", "F32"}, (G, out))
            if kg is not None:
                _need(stored, where, kg, {"I32", "I64"}, (inp,))
            elif self.desc_act:
                raise InvalidInput(f"{where}: {p}g_idx is missing; desc_act (act-order) checkpoints store each "
                                   "input row's group there")
            srcs = (kq, kz, ks) + ((kg,) if kg else ())

            def dec(t, bits=self.bits, g=g, out=out, off=self.offset, where=where, kg=kg):
                q = unpack_int32(t[0], bits, 0)  # [in, out]
                z = unpack_int32(t[1], bits, 1)[:, :out] + off  # [G, out]
                gi = t[3] if len(t) > 3 else None
                if gi is not None and (int(gi.min()) < 0 or int(gi.max()) >= z.shape[0]):
                    raise InvalidInput(f"{where}: {kg} holds groups outside 0..{z.shape[0] - 1}")
                if gi is None:
                    return dequant_scaled(q.t(), t[2].t(), 1, g, zero=z.t())
                return dequant_scaled(q.t(), t[2].t(), 1, 1, zero=z.t(), g_idx=gi)
            v.decoded[p + "weight"] = Entry(srcs, dec, (out, inp), self.name)
        return v


# ---- compressed-tensors -----------------------------------------------------------------------------
CT_INT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
CT_FLOAT_FORMATS = ("float-quantized", "naive-quantized")
CT_STRATEGIES = ("tensor", "channel", "group", "block")


class CompressedTensors(Scheme):
    """compressed-tensors (``quant_method: compressed-tensors``), every config group's weights:
    ``P.weight_packed`` int32 [out, in*bits/32] (+ ``weight_shape``, ``weight_scale`` [out, G],
    ``weight_zero_point`` packed down rows, ``weight_g_idx``) or ``P.weight`` int8 (+
    ``weight_scale``, ``weight_zero_point``) -> ``(q - z) * s``; fp8 ``P.weight`` +
    ``weight_scale`` (per tensor, channel, group or ``block_structure``) -> ``w * s``. Activation
    and KV-cache scales are dropped (ttbundle keeps activations bf16, its own KV storage)."""

    def __init__(self, int_bits: tuple, block, name: str):
        self.int_bits, self.block, self.name = int_bits, block, name

    def view(self, stored, where):
        v = View(self.name)
        for k in stored:
            if k.endswith((".input_scale", ".input_zero_point", ".input_global_scale", ".k_scale", ".v_scale",
                           ".output_scale", ".output_zero_point")):
                v.dropped.add(k)
        for p, (kp, kshape, ks, kz, kg) in companions(
                stored, ("weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "weight_g_idx")).items():
            if kshape is None or ks is None:
                raise InvalidInput(f"{where}: {kp} has no {p}weight_shape / {p}weight_scale beside it "
                                   "(pack-quantized stores both)")
            _need(stored, where, kp, {"I32"}, None)
            srcs = (kp, kshape, ks) + tuple(x for x in (kz, kg) if x)
            # the dense shape is a value (weight_shape), checked when decoded
            v.decoded[p + "weight"] = Entry(srcs, self._packed(where, p, kz, kg), None, self.name)
        for k, (dt, shape) in list(stored.items()):
            if dt == "I8" and k.endswith(".weight"):
                p = k[:-len("weight")]
                ks, kz, kg = (p + s if p + s in stored else None for s in ("weight_scale", "weight_zero_point",
                                                                          "weight_g_idx"))
                if ks is None:
                    raise InvalidInput(f"{where}: {k} is int8 with no {p}weight_scale beside it")
                rule = scale_rule(stored[ks][1], shape[-2], shape[-1])
                if rule is None and kg is None:
                    raise bad_shape(where, ks, stored[ks][1], f"it does not cover {k} {list(shape)}")
                srcs = (k, ks) + tuple(x for x in (kz, kg) if x)
                v.decoded[k] = Entry(srcs, self._int8(kz, kg, rule), tuple(shape), self.name)
        fp8_view(v, stored, where, self.block, ("weight_scale",))
        return v

    def _packed(self, where, p, kz, kg):
        def dec(t):
            shape = [int(x) for x in t[1].tolist()]
            packed, s = t[0], t[2]
            rest = list(t[3:])
            z = rest.pop(0) if kz else None
            gi = rest.pop(0) if kg else None
            out, inp = shape[-2], shape[-1]
            cand = [b for b in self.int_bits if packed.shape[-1] == cdiv(inp, 32 // b)]
            if len(shape) != 2 or packed.shape[-2] != out or not cand:
                raise bad_shape(where, p + "weight_packed", list(packed.shape),
                                f"{p}weight_shape is {shape}; pack-quantized {self.int_bits}-bit values of it do not "
                                "give this shape")
            bits = cand[0]
            off = 1 << (bits - 1)
            q = unpack_int32(packed, bits, 1)[:, :inp] - off  # signed, as compressed-tensors packs
            if z is not None:
                z = unpack_int32(z, bits, 0)[:out] - off
            if gi is not None:
                return dequant_scaled(q, s.reshape(out, -1), 1, 1, zero=z, g_idx=gi)
            rule = scale_rule(s.shape, out, inp)
            if rule is None:
                raise bad_shape(where, p + "weight_scale", list(s.shape), f"it does not cover {p}weight {shape}")
            return dequant_scaled(q, s, *rule, zero=z)
        return dec

    @staticmethod
    def _int8(kz, kg, rule):
        def dec(t):
            rest = list(t[2:])
            z = rest.pop(0) if kz else None
            gi = rest.pop(0) if kg else None
            if gi is not None:
                return dequant_scaled(t[0], t[1], 1, 1, zero=z, g_idx=gi)
            return dequant_scaled(t[0], t[1], *rule, zero=z)
        return dec


def compressed_tensors(qc: dict, where: str) -> CompressedTensors:
    """The scheme of a compressed-tensors config: each config group's weights checked against
    what is read (int 1-8 bits packed or int8, fp8; tensor, channel, group or block)."""
    fmt_all = qc.get("format")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise InvalidInput(f"{where}: quantization_config.config_groups: expected the compressed-tensors "
                           "groups ({name: {targets, weights, ...}})")
    int_bits, blocks, names = set(), set(), set()
    for gname, g in groups.items():
        at = f"config_groups.{gname}"
        w = (g or {}).get("weights") if isinstance(g, dict) else None
        fmt = (g.get("format") if isinstance(g, dict) else None) or fmt_all or "dense"
        if not isinstance(w, dict):
            raise unsupported(where, f"{at}.weights={w!r} (compressed-tensors: weight quantization)")
        typ, bits, strat = w.get("type", "int"), w.get("num_bits"), w.get("strategy", "tensor")
        if strat not in CT_STRATEGIES:
            raise unsupported(where, f"{at}.weights.strategy={strat!r} (compressed-tensors: "
                              f"{', '.join(CT_STRATEGIES)})")
        if typ == "float":
            if bits != 8 or fmt not in CT_FLOAT_FORMATS:
                raise unsupported(where, f"{at}: float num_bits={bits!r} in format {fmt!r} (compressed-tensors "
                                  "floats: fp8 in float-quantized)")
            if strat == "block":
                bs = w.get("block_structure")
                if not (isinstance(bs, (list, tuple)) and len(bs) == 2 and all(isinstance(x, int) and x > 0 for x in bs)):
                    raise InvalidInput(f"{where}: quantization_config.{at}.weights.block_structure={bs!r}: "
                                       "expected [rows, columns]")
                blocks.add(tuple(bs))
            names.add(f"fp8 {strat}")
        elif typ == "int":
            if not isinstance(bits, int) or bits not in (2, 4, 8) or fmt not in CT_INT_FORMATS:
                raise unsupported(where, f"{at}: int num_bits={bits!r} in format {fmt!r} (compressed-tensors "
                                  f"integers: 2, 4 or 8 bits in {', '.join(CT_INT_FORMATS)})")
            if strat == "block":
                raise unsupported(where, f"{at}.weights.strategy='block' for integers")
            int_bits.add(bits)
            names.add(f"int{bits} {strat}{'' if w.get('symmetric', True) else ' asymmetric'}")
        else:
            raise unsupported(where, f"{at}.weights.type={typ!r}")
    if len(blocks) > 1:
        raise unsupported(where, f"config_groups with different block_structure {sorted(blocks)}")
    return CompressedTensors(tuple(sorted(int_bits)), next(iter(blocks), None),
                             "compressed-tensors " + ", ".join(sorted(names)))
