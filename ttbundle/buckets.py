"""`ttbundle buckets`: padding waste of a prefill bucket ladder on real request lengths, and the
ladder of at most K buckets that minimizes the expected padded tokens (exact dynamic program).

Requests are prefilled as the runtime does it (``Runner.prefill``): a prompt longer than the
prefill chunk runs as full chunks plus a remainder, and each piece is padded up to the smallest
bucket that holds it. Buckets are multiples of 32 (a tile row); with ``prefill_chunk`` set the
chunk must stay a bucket (the spec requires it), without it the top bucket must hold the longest
prompt.

Why the dynamic program is exact: an optimal ladder only uses values ``ceil32(piece length)``
(lowering a bucket to the largest such value under it keeps every piece it serves and pads
less), so it chooses a subset of those candidates that contains the top one. With candidates
``c_1 < ... < c_m`` and ``W(i)`` the weight of pieces of rounded length ``<= c_i``:
``f[1][i] = c_i * W(i)``, ``f[k][i] = min_{p<i} f[k-1][p] + c_i * (W(i) - W(p))``; the answer
is ``min_{k<=K} f[k][m]``.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from xml.sax.saxutils import escape

from .errors import InvalidInput
from .tiles import TILE, pick, round_up
from .fsutil import read_user_text

LENGTH_KEYS = ("length", "prompt_len", "prompt_length", "prompt_tokens", "input_tokens", "tokens", "len")
COUNT_KEYS = ("count", "n", "requests", "freq", "frequency", "weight")


def _ceil(n: int, q: int = TILE) -> int:
    return round_up(n, q)


# ---- reading the histogram ---------------------------------------------------------------------------
def read_lengths(path: str | Path) -> dict[int, float]:
    """``{length: count}`` from a CSV (``length[,count]`` rows, header optional; named columns
    ``length``/``prompt_tokens``/... and ``count``/``n``/...) or JSONL (one integer or one object
    with such keys per line). Errors name ``file:line``."""
    path = Path(path)
    text = read_user_text(path, "lengths file", max_bytes=256 << 20)
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    jsonl = path.suffix.lower() in (".jsonl", ".json", ".ndjson") or first.startswith("{")
    rows = _read_jsonl(text, path) if jsonl else _read_csv(text, path)
    hist: dict[int, float] = {}
    for where, length, count in rows:
        if isinstance(length, bool) or not isinstance(length, (int, float)) or length != int(length) or length < 1:
            raise InvalidInput(f"{where}: length must be a positive integer, got {length!r}")
        if isinstance(count, bool) or not isinstance(count, (int, float)) or not math.isfinite(count) or count < 0:
            raise InvalidInput(f"{where}: count must be a non-negative number, got {count!r}")
        hist[int(length)] = hist.get(int(length), 0) + count
    hist = {k: v for k, v in hist.items() if v > 0}
    if not hist:
        raise InvalidInput(f"{path}: no request lengths")
    return dict(sorted(hist.items()))


def _num(s: str, where: str):
    try:
        v = float(s)
    except ValueError:
        raise InvalidInput(f"{where}: {s!r} is not a number") from None
    return int(v) if v.is_integer() else v


def _read_csv(text: str, path: Path):
    rows = [r for r in csv.reader(text.splitlines())]
    out, li, ci, start = [], 0, None, 0
    first = next((i for i, r in enumerate(rows) if any(c.strip() for c in r)), None)
    if first is None:
        return out
    head = [c.strip().lower() for c in rows[first]]
    if any(h and not _isnum(h) for h in head):  # a header row
        li = next((head.index(k) for k in LENGTH_KEYS if k in head), None)
        if li is None:
            raise InvalidInput(f"{path}:{first + 1}: no length column; name one of {', '.join(LENGTH_KEYS)}")
        ci = next((head.index(k) for k in COUNT_KEYS if k in head), None)
        start = first + 1
    else:
        ci = 1 if len(head) > 1 else None
    for i, r in enumerate(rows[start:], start + 1):
        if not any(c.strip() for c in r) or r[0].lstrip().startswith("#"):
            continue
        where = f"{path}:{i}"
        if len(r) != len(head):
            raise InvalidInput(f"{where}: expected {len(head)} columns like line {first + 1}, got {len(r)}")
        out.append((where, _num(r[li].strip(), where), 1 if ci is None else _num(r[ci].strip(), where)))
    return out


def _isnum(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def _read_jsonl(text: str, path: Path):
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{i}"
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise InvalidInput(f"{where}: not JSON: {e}") from None
        if isinstance(obj, dict):
            lk = next((k for k in LENGTH_KEYS if k in obj), None)
            if lk is None:
                raise InvalidInput(f"{where}: no length key; use one of {', '.join(LENGTH_KEYS)}")
            ck = next((k for k in COUNT_KEYS if k in obj), None)
            out.append((where, obj[lk], 1 if ck is None else obj[ck]))
        else:
            out.append((where, obj, 1))
    return out


# ---- pieces, cost, ladders --------------------------------------------------------------------------------
def pieces(hist: dict[int, float], chunk: int | None) -> dict[int, float]:
    """Prefill pieces ``{length: weight}``: full chunks plus the remainder of each prompt."""
    out: dict[int, float] = {}
    for n, w in hist.items():
        if chunk:
            full, rest = divmod(n, chunk)
            if full:
                out[chunk] = out.get(chunk, 0) + w * full
        else:
            rest = n
        if rest:
            out[rest] = out.get(rest, 0) + w
    return dict(sorted(out.items()))


def assign(ladder: list[int], n: int) -> int | None:
    """The bucket of ``ladder`` piece ``n`` pads to (``tiles.pick``), None when it exceeds the top."""
    return pick(ladder, n) if ladder and n <= max(ladder) else None


def cost(piece_hist: dict[int, float], ladder: list[int]) -> float:
    """Padded tokens of every piece under ``ladder`` (inf when a piece exceeds the top)."""
    total = 0.0
    for n, w in piece_hist.items():
        b = assign(ladder, n)
        if b is None:
            return math.inf
        total += w * b
    return total


def optimal_ladder(piece_hist: dict[int, float], k: int, top: int | None = None) -> tuple[list[int], float]:
    """The ladder of at most ``k`` multiples of 32 that minimizes padded tokens, containing
    ``top`` when given (the prefill chunk); exact (see the module docstring)."""
    import numpy as np

    if k < 1:
        raise InvalidInput("--max-traces must be at least 1")
    weight: dict[int, float] = {}
    for n, w in piece_hist.items():
        weight[_ceil(n)] = weight.get(_ceil(n), 0) + w
    if top is not None:
        if top < max(weight):
            raise ValueError(f"top bucket {top} < longest piece {max(weight)}")
        weight.setdefault(top, 0.0)
    c = np.array(sorted(weight), dtype=np.float64)
    W = np.cumsum([weight[int(x)] for x in c])
    m = len(c)
    k = min(k, m)
    f = c * W  # one bucket: the candidate itself holds everything up to it
    best, best_k = f[m - 1], 1
    back = np.full((k + 1, m), -1, dtype=np.int64)
    layers = [f]
    for kk in range(2, k + 1):
        g = np.full(m, np.inf)
        prev = layers[-1]
        for i in range(kk - 1, m):
            cand = prev[:i] + c[i] * (W[i] - W[:i])
            p = int(np.argmin(cand))
            g[i], back[kk, i] = cand[p], p
        layers.append(g)
        if g[m - 1] < best - 1e-9 * max(1.0, abs(best)):
            best, best_k = g[m - 1], kk
    ladder, i = [], m - 1
    for kk in range(best_k, 0, -1):
        ladder.append(int(c[i]))
        i = back[kk, i]
    return sorted(ladder), float(best)


# ---- the report -----------------------------------------------------------------------------------------------
@dataclass
class BucketStat:
    bucket: int
    pieces: float
    real_tokens: float
    padded_tokens: float

    @property
    def waste(self) -> float:
        return self.padded_tokens - self.real_tokens

    def to_json(self) -> dict:
        d = asdict(self)
        d["waste_tokens"] = self.waste
        d["waste_pct"] = 100 * self.waste / self.padded_tokens if self.padded_tokens else 0.0
        return d


@dataclass
class Ladder:
    buckets: list[int]
    stats: list[BucketStat]
    padded_per_request: float
    real_per_request: float

    @property
    def waste_pct(self) -> float:
        return 100 * (1 - self.real_per_request / self.padded_per_request) if self.padded_per_request else 0.0

    def to_json(self) -> dict:
        return {"buckets": self.buckets, "padded_tokens_per_request": self.padded_per_request,
                "real_tokens_per_request": self.real_per_request, "waste_pct": self.waste_pct,
                "per_bucket": [s.to_json() for s in self.stats]}


@dataclass
class Report:
    requests: float
    chunk: int | None
    max_traces: int
    current: Ladder
    proposed: Ladder
    hist: dict = field(default_factory=dict)
    skipped: float = 0  # requests longer than max_model_len

    @property
    def saving_pct(self) -> float:
        c, p = self.current.padded_per_request, self.proposed.padded_per_request
        return 100 * (c - p) / c if c else 0.0

    def to_json(self) -> dict:
        return {"requests": self.requests, "skipped_over_max_model_len": self.skipped,
                "prefill_chunk": self.chunk, "max_traces": self.max_traces,
                "current": self.current.to_json(), "proposed": self.proposed.to_json(),
                "saving_pct": self.saving_pct}


def ladder_stats(piece_hist: dict[int, float], ladder: list[int], requests: float) -> Ladder:
    stats = {b: BucketStat(b, 0, 0, 0) for b in ladder}
    for n, w in piece_hist.items():
        b = assign(ladder, n)
        s = stats[b]
        s.pieces += w
        s.real_tokens += w * n
        s.padded_tokens += w * b
    padded = sum(s.padded_tokens for s in stats.values())
    real = sum(s.real_tokens for s in stats.values())
    return Ladder(list(ladder), [stats[b] for b in ladder], padded / requests, real / requests)


def analyze(bundle, hist: dict[int, float], max_traces: int | None = None) -> Report:
    """Current ladder (the spec's prefill buckets) against the optimal one of ``max_traces``
    buckets (default: as many as the spec has)."""
    bk, rt = bundle.buckets, bundle.spec.runtime
    chunk = bk.prefill_chunk
    k = max_traces if max_traces is not None else len(bk.prefill)
    kept = {n: w for n, w in hist.items() if n <= rt.max_model_len}
    skipped = sum(w for n, w in hist.items() if n > rt.max_model_len)
    if not kept:
        raise InvalidInput(f"every request is longer than runtime.max_model_len={rt.max_model_len}")
    requests = sum(kept.values())
    ph = pieces(kept, chunk)
    current = list(bk.prefill)
    if assign(current, max(ph)) is None:
        raise InvalidInput(f"a {max(ph)}-token prefill piece exceeds the largest bucket {current[-1]}; "
                           "the spec cannot serve these lengths")
    ladder, _ = optimal_ladder(ph, k, top=chunk)
    return Report(requests, chunk, k, ladder_stats(ph, current, requests),
                  ladder_stats(ph, ladder, requests), dict(kept), skipped)


# ---- SVG ----------------------------------------------------------------------------------------------------------
def render_svg(r: Report, title: str = "") -> str:
    """Histogram of request lengths with the current (dashed) and proposed (solid) bucket edges,
    and under it each bucket's padding waste for both ladders."""
    W, H, L, R, T = 900, 420, 70, 20, 40
    plot_h = 220
    base = T + plot_h
    xmax = max(max(r.hist), r.current.buckets[-1], r.proposed.buckets[-1])
    nbins = min(80, max(10, len(r.hist)))
    binw = _ceil(max(1, -(-xmax // nbins)), 1)
    bins: dict[int, float] = {}
    for n, w in r.hist.items():
        bins[(n - 1) // binw] = bins.get((n - 1) // binw, 0) + w
    ymax = max(bins.values())

    def x(v: float) -> float:
        return L + (W - L - R) * v / xmax

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
           'font-family="sans-serif" font-size="11">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{L}" y="20" font-size="14" font-weight="bold">{escape(title or "request lengths")}'
           f' ({r.requests:,.0f} requests)</text>']
    for i, w in sorted(bins.items()):
        h = plot_h * w / ymax
        out.append(f'<rect x="{x(i * binw):.1f}" y="{base - h:.1f}" width="{max(0.5, x((i + 1) * binw) - x(i * binw) - 0.5):.1f}" '
                   f'height="{h:.1f}" fill="#8aa8d0"><title>{i * binw + 1}-{(i + 1) * binw} tokens: {w:,.0f}</title></rect>')
    out.append(f'<line x1="{L}" y1="{base}" x2="{W - R}" y2="{base}" stroke="black"/>')
    out.append(f'<line x1="{L}" y1="{T}" x2="{L}" y2="{base}" stroke="black"/>')
    for v in _ticks(xmax):
        out.append(f'<text x="{x(v):.1f}" y="{base + 14}" text-anchor="middle">{v}</text>')
    out.append(f'<text x="{L - 6}" y="{T + 8}" text-anchor="end">{ymax:,.0f}</text>')
    out.append(f'<text x="{(L + W - R) / 2}" y="{base + 30}" text-anchor="middle">prompt tokens</text>')
    for ladder, dash, color in ((r.current, "6,4", "#c0392b"), (r.proposed, "", "#1e8449")):
        for b in ladder.buckets:
            out.append(f'<line x1="{x(b):.1f}" y1="{T}" x2="{x(b):.1f}" y2="{base}" stroke="{color}" '
                       f'stroke-width="1.5"' + (f' stroke-dasharray="{dash}"' if dash else "") + "/>")
    y = base + 50
    for label, ladder, color in (("current", r.current, "#c0392b"), ("proposed", r.proposed, "#1e8449")):
        out.append(f'<text x="{L - 6}" y="{y + 14}" text-anchor="end" fill="{color}">{label}</text>')
        lo = 0
        for s in ladder.stats:
            pct = s.to_json()["waste_pct"]
            shade = f"rgba(192,57,43,{0.1 + 0.8 * pct / 100:.2f})"
            out.append(f'<rect x="{x(lo):.1f}" y="{y}" width="{max(1.0, x(s.bucket) - x(lo)):.1f}" height="20" '
                       f'fill="{shade}" stroke="{color}"><title>bucket {s.bucket}: {s.pieces:,.0f} pieces, '
                       f'{s.waste:,.0f} padding tokens ({pct:.1f}%)</title></rect>')
            out.append(f'<text x="{(x(lo) + x(s.bucket)) / 2:.1f}" y="{y + 14}" text-anchor="middle">'
                       f'{s.bucket}: {pct:.0f}%</text>')
            lo = s.bucket
        out.append(f'<text x="{W - R}" y="{y + 34}" text-anchor="end">{ladder.padded_per_request:,.1f} padded '
                   f'tokens/request, {ladder.waste_pct:.1f}% padding</text>')
        y += 50
    out.append(f'<text x="{L}" y="{H - 8}">dashed: current edges; solid: proposed (at most '
               f'{r.max_traces} buckets{", chunk " + str(r.chunk) if r.chunk else ""}); band shade = padding share</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _ticks(xmax: int) -> list[int]:
    """Round tick values (1, 2 or 5 times a power of ten apart), at most about 10."""
    step = 1
    while xmax / step > 10:
        for m in (2, 5, 10):
            if xmax / (step * m) <= 10 or m == 10:
                step *= m
                break
    return list(range(0, xmax + 1, step))


def print_report(r: Report, console, name: str = "") -> None:
    from rich.table import Table
    for label, ladder in (("current", r.current), ("proposed", r.proposed)):
        t = Table(title=f"{label} prefill buckets {ladder.buckets}", title_justify="left", show_edge=False)
        for c in ("bucket", "pieces", "real tokens", "padded tokens", "padding", "padding %"):
            t.add_column(c, justify="right")
        for s in ladder.stats:
            j = s.to_json()
            t.add_row(str(s.bucket), f"{s.pieces:,.0f}", f"{s.real_tokens:,.0f}", f"{s.padded_tokens:,.0f}",
                      f"{s.waste:,.0f}", f"{j['waste_pct']:.1f}")
        console.print(t)
        console.print(f"  {ladder.padded_per_request:,.1f} padded tokens per request "
                      f"({ladder.real_per_request:,.1f} real, {ladder.waste_pct:.1f}% padding)")
    chunk = f", prefill_chunk {r.chunk} kept" if r.chunk else ""
    console.print(f"{r.requests:,.0f} requests; best ladder of at most {r.max_traces} buckets{chunk}: "
                  f"{r.proposed.buckets} saves {r.saving_pct:.1f}% of padded prefill tokens")
    if r.skipped:
        console.print(f"note: {r.skipped:,.0f} requests longer than max_model_len were left out")
