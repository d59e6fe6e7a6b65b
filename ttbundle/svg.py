"""A plan drawn as one self-contained SVG for design reviews.

``render_plan(plan)`` returns the SVG text: a header (bundle, mesh, verdict), the mesh as a grid of
chips each with a stacked DRAM bar, every tensor's global shape cut into the blocks the mesh axes
split it into, and the collectives with their bytes per decode token. Pure formatting, like
``report.py``: no decisions here. The output uses generic font families only, no scripts or
external references, escapes every piece of text, and is byte-for-byte deterministic.

Elements carry ``class`` names tests and tools can select on: ``chip`` (one per device, plus
``over-capacity`` when the plan does not fit), ``bar-frame``, ``seg seg-<segment>`` (with
``data-bytes``), ``capacity``, ``tensor``, ``shard``, ``collective``.
"""

from __future__ import annotations

import math
import re

from . import __version__
from .layout import axes_of
from .mesh import AXES
from .plan.make import Plan
from .plan.memory import percent as pct, verdict
from .plan.sharding import TensorPlan, fmt_entry
from .report import human

WIDTH = 1000
MARGIN = 20
FONT = "DejaVu Sans Mono, Menlo, Consolas, monospace"
CHAR_W = 0.6  # monospace advance per font-size unit, for layout

# (key, label, colour): the stacked DRAM bar, bottom to top of the allocator's view
SEGMENTS = (("weights", "weights", "#4e79a7"), ("kv_cache", "KV cache", "#f28e2b"),
            ("activations", "activations", "#59a14f"), ("trace_region", "trace region", "#b07aa1"),
            ("draft", "draft model", "#edc948"), ("free", "free", "#e6e6e6"))
RED, GREEN, INK, GREY = "#d62728", "#2e7d32", "#222222", "#777777"
SHARD_OWN, SHARD_OTHER = "#4e79a7", "#dbe4ef"

_BAD_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def esc(s: object) -> str:
    """Text or attribute value, XML-escaped (``<&>"'``) with XML-illegal control chars dropped."""
    s = _BAD_XML.sub("", str(s))
    return (s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
            .replace('"', "&quot;").replace("'", "&#39;"))


def num(x: float) -> str:
    """Coordinate with at most 3 decimals, no trailing zeros (stable across platforms)."""
    s = f"{x:.3f}".rstrip("0").rstrip(".")
    return "0" if s in ("-0", "") else s


def _wrap(s: str, size: float, width: float, max_lines: int = 3) -> list[str]:
    """``s`` broken at spaces into lines of ``width`` px at font ``size`` (last one cut to fit)."""
    n = max(1, int(width / (size * CHAR_W)))
    lines: list[str] = []
    for word in s.split(" "):
        if lines and len(lines[-1]) + 1 + len(word) <= n:
            lines[-1] += " " + word
        else:
            lines.append(word)
    if len(lines) > max_lines:
        lines = lines[:max_lines - 1] + [" ".join(lines[max_lines - 1:])]
    return [_fit(x, size, width) for x in lines]


def _fit(s: str, size: float, width: float) -> str:
    """``s`` cut with an ellipsis to fit ``width`` px at font ``size``."""
    n = max(1, int(width / (size * CHAR_W)))
    return s if len(s) <= n else s[: n - 1] + "\u2026"


class _Svg:
    def __init__(self):
        self.parts: list[str] = []

    def add(self, s: str):
        self.parts.append(s)

    def rect(self, x, y, w, h, fill="none", stroke=None, sw=1.0, cls=None, title=None, extra=""):
        a = f'<rect x="{num(x)}" y="{num(y)}" width="{num(max(w, 0))}" height="{num(max(h, 0))}" fill="{fill}"'
        if stroke:
            a += f' stroke="{stroke}" stroke-width="{num(sw)}"'
        if cls:
            a += f' class="{esc(cls)}"'
        a += extra
        self.add(a + (f"><title>{esc(title)}</title></rect>" if title else "/>"))

    def line(self, x1, y1, x2, y2, stroke=GREY, sw=1.0, cls=None, dash=None):
        a = (f'<line x1="{num(x1)}" y1="{num(y1)}" x2="{num(x2)}" y2="{num(y2)}" stroke="{stroke}" '
             f'stroke-width="{num(sw)}"')
        if dash:
            a += f' stroke-dasharray="{dash}"'
        if cls:
            a += f' class="{esc(cls)}"'
        self.add(a + "/>")

    def text(self, x, y, s, size=11, fill=INK, bold=False, anchor=None, cls=None, rotate=None):
        a = f'<text x="{num(x)}" y="{num(y)}" font-size="{num(size)}"'
        if fill != INK:
            a += f' fill="{fill}"'
        if bold:
            a += ' font-weight="bold"'
        if anchor:
            a += f' text-anchor="{anchor}"'
        if cls:
            a += f' class="{esc(cls)}"'
        if rotate is not None:
            a += f' transform="rotate({num(rotate)} {num(x)} {num(y)})"'
        self.add(f"{a}>{esc(s)}</text>")


def segment_bytes(p: Plan) -> list[tuple[str, str, str, int]]:
    """(key, label, colour, bytes per chip) for each stacked-bar segment; free is 0 when over;
    the draft model's (speculative decoding) only when the plan has one."""
    m = p.memory
    vals = {"weights": m.weights, "kv_cache": m.kv_cache, "activations": m.activations,
            "trace_region": m.trace_region, "draft": m.draft, "free": max(m.free, 0)}
    return [(k, label, colour, vals[k]) for k, label, colour in SEGMENTS if k != "draft" or m.draft]


def render_plan(plan: Plan) -> str:
    """The plan as a standalone SVG document (UTF-8 text, deterministic)."""
    g = _Svg()
    y = _header(g, plan, MARGIN)
    y = _memory(g, plan, y + 18)
    y = _tensors(g, plan, y + 22)
    y = _collectives(g, plan, y + 22)
    g.text(MARGIN, y + 16, f"ttbundle {__version__} \u00b7 ttbundle plan --svg", 9, GREY)
    height = math.ceil(y + 26)
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
            f'viewBox="0 0 {WIDTH} {height}" font-family="{FONT}">')
    title = f"{plan.bundle_name} on {plan.mesh.describe()}: sharding and per-chip DRAM plan"
    body = "\n".join(g.parts)
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n{head}\n<title>{esc(title)}</title>\n'
            f'<rect x="0" y="0" width="{WIDTH}" height="{height}" fill="#ffffff"/>\n{body}\n</svg>\n')


# ---- (a) header -----------------------------------------------------------------------------
def _header(g: _Svg, p: Plan, y: float) -> float:
    m, mem = p.mesh, p.memory
    g.text(MARGIN, y + 16, f"{p.bundle_name} ({p.family}) on {m.name} {m.rows}x{m.cols}", 18, bold=True)
    g.text(MARGIN, y + 36, f"{m.num_devices} x {m.chip.label} ({m.chip.arch}), {m.topology}, "
           f"axes rows={m.rows} cols={m.cols}; {human(m.chip.dram_bytes)} DRAM per chip"
           + (f" ({m.note})" if m.note else ""), 12)
    fits, word, numbers = verdict(mem, human)  # plan.memory's wording; capitals where it does not fit
    colour = GREEN if fits else RED
    g.rect(MARGIN, y + 45, 12, 12, colour, cls="verdict " + ("fits" if fits else "over-capacity"))
    g.text(MARGIN + 18, y + 55, f"{word if fits else word.upper()}: {numbers}", 13, colour, bold=True)
    g.text(MARGIN, y + 74, f"decode traffic: {p.decode_traffic_bytes_per_token:,} B per token per "
           f"device over {len(p.collectives)} collective(s); {p.num_traces} traces, activations "
           f"sized for {p.activation_tokens} tokens", 11, GREY)
    return y + 80


# ---- (b) mesh of chips with stacked DRAM bars ---------------------------------------------------
def _memory(g: _Svg, p: Plan, y: float) -> float:
    m, mem = p.mesh, p.memory
    segs = segment_bytes(p)
    g.text(MARGIN, y + 14, "per-chip DRAM (the same on every chip)", 14, bold=True)
    y += 24
    # legend: one row per segment with its bytes
    details = {
        "weights": ", ".join(f"{dt} {human(n)}" for dt, n in sorted(mem.weights_by_dtype.items())),
        "kv_cache": f"{p.kv.get('dtype', '')}, {p.kv.get('num_blocks', 0):,} blocks x "
                    f"{p.kv.get('block_size', 0)} tokens",
        "activations": f"largest layer, {p.activation_tokens} tokens",
        "trace_region": f"{p.num_traces} captured traces",
        "draft": p.draft_line() if mem.draft else "",
        "free": "" if p.fits else f"none: over capacity by {human(-mem.free)}",
    }
    for key, label, colour, n in segs:
        g.rect(MARGIN, y + 3, 12, 12, colour, "#999999", 0.5, cls=f"legend legend-{key}")
        g.text(MARGIN + 18, y + 13, label, 11)
        g.text(MARGIN + 225, y + 13, human(n), 11, anchor="end")
        g.text(MARGIN + 235, y + 13, f"{n:,} B", 11, GREY)
        g.text(MARGIN + 410, y + 13, pct(n, mem.dram), 11, GREY, anchor="end")
        d = details[key]
        if d:
            g.text(MARGIN + 425, y + 13, _fit(d, 11, WIDTH - 2 * MARGIN - 425), 11,
                   RED if key == "free" and not p.fits else GREY)
        y += 17
    g.text(MARGIN + 18, y + 13, "total", 11, bold=True)
    g.text(MARGIN + 225, y + 13, human(mem.total), 11, bold=True, anchor="end")
    g.text(MARGIN + 235, y + 13, f"{mem.total:,} B", 11, GREY)
    g.text(MARGIN + 410, y + 13, pct(mem.total, mem.dram), 11, RED if not p.fits else GREY, anchor="end")
    g.text(MARGIN + 425, y + 13, f"of {human(mem.dram)} ({m.chip.dram_banks} banks x "
           f"{m.chip.dram_bank_bytes:,} B)", 11, GREY)
    y += 24

    # the used bytes alone, so small plans still show what dominates
    if mem.total > 0:
        g.text(MARGIN, y + 10, f"used {human(mem.total)}, split (scaled to the used bytes, not to DRAM):",
               11, GREY)
        y += 15
        bw, x = WIDTH - 2 * MARGIN, float(MARGIN)
        for key, label, colour, n in segs:
            if key == "free" or n == 0:
                continue
            w = n * bw / mem.total
            g.rect(x, y, w, 14, colour, cls=f"used-seg used-{key}", title=f"{label}: {human(n)}")
            tag = f"{label} {pct(n, mem.total)}"
            if w > len(tag) * 10 * CHAR_W + 6:
                g.text(x + 3, y + 11, tag, 10, "#ffffff")
            x += w
        g.rect(MARGIN, y, bw, 14, stroke="#999999", sw=0.5)
        y += 26

    # the grid: rows x cols chips, bars scaled to chip DRAM (or to the total when over)
    over = not p.fits
    scale_to = max(mem.total, mem.dram)
    left = MARGIN + 22
    avail = WIDTH - MARGIN - left
    gap = 8 if m.cols <= 8 else 4
    cw = min(220.0, (avail - (m.cols - 1) * gap) / m.cols)
    ch = 50.0 if cw >= 90 else 36.0
    vgap = gap
    g.text(MARGIN, y + 10, f"mesh {m.rows}x{m.cols}: one box per chip, bar = its {human(mem.dram)} "
           + ("of DRAM" if not over else f"of DRAM (red line) against the {human(mem.total)} needed"),
           11, GREY)
    y += 22
    gw = m.cols * cw + (m.cols - 1) * gap
    gh = m.rows * ch + (m.rows - 1) * vgap
    g.text(left + gw / 2, y, f"cols ({m.cols}) \u2192", 11, GREY, anchor="middle")
    for label in (f"rows ({m.rows}) \u2192", f"rows={m.rows}"):  # rotated: it reads downwards
        if len(label) * 11 * CHAR_W <= gh:
            g.text(MARGIN + 10, y + 6 + gh / 2, label, 11, GREY, anchor="middle", rotate=90)
            break
    y += 6
    used = pct(mem.total, mem.dram)
    pad = 6.0 if cw >= 60 else 3.0
    bar_h = 14.0 if ch >= 50 else 10.0
    for r in range(m.rows):
        for c in range(m.cols):
            x0, y0 = left + c * (cw + gap), y + r * (ch + vgap)
            tip = f"chip ({r},{c}): {human(mem.total)} of {human(mem.dram)} ({used})"
            g.rect(x0, y0, cw, ch, "#fafafa", RED if over else "#888888", 2.0 if over else 1.0,
                   cls="chip over-capacity" if over else "chip", title=tip,
                   extra=f' data-device="{r},{c}"')
            if cw >= 34:
                g.text(x0 + pad, y0 + 13, f"{r},{c}", 10 if cw >= 60 else 8, GREY)
            if cw >= 90:
                g.text(x0 + cw - pad, y0 + 13, used + (" !" if over else ""), 10,
                       RED if over else GREY, anchor="end", bold=over)
            bx, by, bw = x0 + pad, y0 + ch - pad - bar_h, cw - 2 * pad
            sx = bx
            for key, label, colour, n in segs:
                w = n * bw / scale_to
                g.rect(sx, by, w, bar_h, colour, cls=f"seg seg-{key}",
                       extra=f' data-bytes="{n}"')
                sx += w
            g.rect(bx, by, bw, bar_h, stroke="#999999", sw=0.5, cls="bar-frame",
                   extra=f' data-scale-bytes="{scale_to}"')
            if over:
                cx = bx + mem.dram * bw / scale_to
                g.line(cx, by - 3, cx, by + bar_h + 3, RED, 2.0, cls="capacity")
    return y + gh


# ---- (c) tensors split over the axes ------------------------------------------------------------
def _splits(t: TensorPlan, p: Plan) -> list[int]:
    """Distinct blocks per dim: the product of the sizes of the axes that split it, or fewer when
    devices share a block (KV heads replicated) or some hold only padding."""
    out = []
    for n, dev, e in zip(t.shape, t.device_shape, t.spec):
        k = math.prod(p.mesh.axis_size(a) for a in axes_of(e))
        out.append(k if dev * k == n or dev <= 0 else max(1, min(k, -(-n // dev))))
    return out


def _tensor_label(t: TensorPlan) -> tuple[str, str]:
    dev = "[" + ", ".join(map(str, t.device_shape)) + "]"
    return f"{t.name} {t.notation()}", f"-> {dev} per chip"


def layer_tensors(p: Plan) -> tuple[list[TensorPlan], list[TensorPlan]]:
    """(tensors of the decoder layers, tensors outside them): a tensor the embedding or head
    program reads is outside; without recorded programs, a tensor with one copy is."""
    outside: set[str] = set()
    programs = getattr(p, "programs", None) or []
    for name, _count, steps in programs:
        if name in ("embedding", "head"):
            outside.update(w for st in steps if (w := getattr(getattr(st, "op", None), "w", None)))
    if not programs:
        outside = {t.name for t in p.tensors if t.count == 1}
    return ([t for t in p.tensors if t.name not in outside], [t for t in p.tensors if t.name in outside])


def _tensors(g: _Svg, p: Plan, y: float) -> float:
    g.text(MARGIN, y + 14, "one layer's tensors split over the axes", 14, bold=True)
    g.text(MARGIN, y + 30, "box = global shape (dim 0 down, dim 1 across), cut into one block per device "
           "along each split dim;", 11, GREY)
    g.text(MARGIN, y + 44, "dark block = chip (0,0)'s shard; replicated dims stay whole; "
           "xN = copies (layers) per chip", 11, GREY)
    y += 54
    if not p.tensors:
        g.text(MARGIN, y + 14, "no tensors", 11, GREY)
        return y + 20
    maxdim = max(max(t.shape) for t in p.tensors)
    inside, outside = layer_tensors(p)
    y = _tensor_grid(g, p, inside, y, maxdim)
    if outside:
        g.text(MARGIN, y + 14, "outside the layers (embedding, final norm, LM head)", 12, bold=True)
        y = _tensor_grid(g, p, outside, y + 24, maxdim)
    return y


def _tensor_grid(g: _Svg, p: Plan, tensors: list[TensorPlan], y: float, maxdim: int) -> float:
    m = p.mesh
    box_max, box_min = 100.0, 22.0

    def side(n: int, blocks: int) -> float:
        s = box_min + (box_max - box_min) * math.sqrt(n / maxdim)
        return min(box_max, max(s, 3.0 * blocks))

    col_w = (WIDTH - 2 * MARGIN - 20) / 2
    text_x, fs = box_max + 12, 11.0
    cells = []
    for t in tensors:
        splits = _splits(t, p)
        used = {a for e in t.spec for a in axes_of(e)}
        lines = []
        l1, l2 = _tensor_label(t)
        one = f"{l1} {l2}"
        if len(one) * fs * CHAR_W <= col_w - text_x:
            lines.append(("label", one))
        else:
            lines += [("label", x) for x in _wrap(l1, fs, col_w - text_x) + [l2]]
        spec = "[" + ", ".join(fmt_entry(e) for e in t.spec) + "]"
        lines.append(("info", f"{spec} {t.layout} x{t.count}: {human(t.bytes)} per chip"))
        rep = [f"{a}({m.axis_size(a)})" for a in AXES if a not in used and m.axis_size(a) > 1]
        if rep:
            lines.append(("info", f"whole copy on every chip of {' x '.join(rep)}" if not used
                          else f"replicated along {', '.join(rep)}"))
        for note in t.notes:
            lines.append(("note", note))
        cells.append((t, splits, lines))

    for i in range(0, len(cells), 2):
        row = cells[i:i + 2]
        heights = []
        for j, (t, splits, lines) in enumerate(row):
            x0 = MARGIN + j * (col_w + 20)
            heights.append(_tensor_cell(g, t, splits, lines, x0, y, col_w, text_x, side))
        y += max(heights) + 14
    return y


def _tensor_cell(g, t, splits, lines, x0, y0, col_w, text_x, side) -> float:
    shape = t.shape
    g.add(f'<g class="tensor" data-name="{esc(t.name)}">')
    if len(shape) == 1:
        n0, n1, h0, w1 = 1, splits[0], 10.0, side(shape[0], splits[0])
        lead = 1
    else:
        n0, n1 = splits[-2], splits[-1]
        h0, w1 = side(shape[-2], n0), side(shape[-1], n1)
        lead = math.prod(splits[:-2]) if len(shape) > 2 else 1
    # leading (e.g. expert) dims: a stack of cards behind, one per block up to 3
    depth = min(3, max(lead, 2 if len(shape) > 2 else 1) - 1)
    bx, by = x0 + depth * 4, y0 + 2 + depth * 4
    for k in range(depth, 0, -1):
        g.rect(bx - k * 4, by - k * 4, w1, h0, "#f3f3f3", "#999999", 0.5)
    bh, bwid = h0 / n0, w1 / n1
    for r in range(n0):
        for c in range(n1):
            own = r == 0 and c == 0
            g.rect(bx + c * bwid, by + r * bh, bwid, bh, SHARD_OWN if own else SHARD_OTHER,
                   "#ffffff" if n0 * n1 > 1 else None, 0.5 if n0 * n1 > 1 else 1.0,
                   cls="shard own" if own else "shard")
    g.rect(bx, by, w1, h0, stroke="#555555", sw=1.0, cls="tensor-frame",
           extra=f' data-blocks="{n0}x{n1}"')
    if len(shape) > 2:
        g.text(bx, by + h0 + 11, f"{' x '.join(map(str, shape[:-2]))} deep", 9, GREY)
        if lead > 1:
            g.text(bx, by + h0 + 21, f"in {lead} blocks", 9, GREY)
    ty = y0 + 11
    for kind, s in lines:
        if kind == "label":
            g.text(x0 + text_x, ty, _fit(s, 11, col_w - text_x), 11, bold=True)
            ty += 14
            continue
        for part in _wrap(s, 10, col_w - text_x):
            g.text(x0 + text_x, ty, part, 10, "#b35900" if kind == "note" else GREY)
            ty += 13
    g.add("</g>")
    return max(h0 + depth * 4 + (24 if len(shape) > 2 else 4), ty - y0 - 6)


# ---- (d) collectives --------------------------------------------------------------------------
def _collectives(g: _Svg, p: Plan, y: float) -> float:
    g.text(MARGIN, y + 14, "collectives per decode token (bytes each device sends, ring algorithm)",
           14, bold=True)
    y += 24
    if not p.collectives:
        g.text(MARGIN, y + 12, "none: nothing is split across devices", 11, GREY)
        return y + 18
    cols = [("layer", MARGIN, None), ("op", MARGIN + 80, None), ("collective", MARGIN + 260, None),
            ("axis (group)", MARGIN + 350, None), ("x/fwd", MARGIN + 500, "end"),
            ("payload B", MARGIN + 585, "end"), ("B/token", MARGIN + 665, "end"),
            ("x count", MARGIN + 755, "end")]
    for label, x, anchor in cols:
        g.text(x, y + 12, label, 10, GREY, bold=True, anchor=anchor)
    y += 16
    g.line(MARGIN, y, WIDTH - MARGIN, y, "#cccccc")
    bar_x, bar_w = MARGIN + 770, WIDTH - 2 * MARGIN - 770
    top = max(c.traffic_bytes_per_token * c.count for c in p.collectives) or 1
    for c in p.collectives:
        total = c.traffic_bytes_per_token * c.count
        vals = [c.layer, c.op, c.kind, f"{'*'.join(c.axes)} ({c.devices})", str(c.count),
                f"{c.payload_bytes_per_token:,}", f"{c.traffic_bytes_per_token:,}", f"{total:,}"]
        widths = [78, 178, 88, 140, 0, 0, 0, 0]
        g.add(f'<g class="collective" data-layer="{esc(c.layer)}" data-bytes="{total}">')
        for (label, x, anchor), v, w in zip(cols, vals, widths):
            g.text(x, y + 13, _fit(v, 11, w) if w else v, 11, anchor=anchor)
        g.rect(bar_x, y + 4, total * bar_w / top, 10,
               "#4e79a7" if c.kind == "all_reduce" else "#f28e2b")
        g.add("</g>")
        y += 16
    g.line(MARGIN, y + 2, WIDTH - MARGIN, y + 2, "#cccccc")
    y += 6
    by_layer: dict[str, list[int]] = {}
    for c in p.collectives:
        s = by_layer.setdefault(c.layer, [0, c.count])
        s[0] += c.traffic_bytes_per_token
    for layer, (b, n) in by_layer.items():
        g.text(MARGIN, y + 13, f"{layer}: {b:,} B per layer per token, x{n} = {b * n:,} B" if n > 1
               else f"{layer}: {b:,} B per token", 11)
        y += 15
    g.text(MARGIN, y + 15, f"decode total: {p.decode_traffic_bytes_per_token:,} B "
           f"({human(p.decode_traffic_bytes_per_token)}) per token per device", 11, bold=True)
    g.rect(WIDTH - MARGIN - 190, y + 5, 10, 10, "#4e79a7")
    g.text(WIDTH - MARGIN - 176, y + 14, "all_reduce", 10, GREY)
    g.rect(WIDTH - MARGIN - 100, y + 5, 10, 10, "#f28e2b")
    g.text(WIDTH - MARGIN - 86, y + 14, "all_gather", 10, GREY)
    return y + 22
