"""Host-side tables both backends feed their kernels: rope cos/sin (the rope variants of
HF's ``ROPE_INIT_FUNCTIONS``), M-RoPE's row per column, the rotate-half matrix and the vision
pooling matrix. The emulated kernels apply them; the ttnn lowering uploads them as constants
(``backends/ttnn/device.py``). One owner, so the two backends cannot drift apart.
"""

from __future__ import annotations

import math

import torch


# ---- rope tables ---------------------------------------------------------------------------------------
def rope_inv_freq(dim: int, theta: float, scaling) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float64) and the attention scaling factor for a rope variant."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    kind = getattr(scaling, "rope_type", "default") if scaling is not None else "default"
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / scaling.factor, 1.0
    if kind == "llama3":
        factor, lo, hi = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
        old = scaling.original_max_position_embeddings
        lo_wl, hi_wl = old / lo, old / hi
        wl = 2 * math.pi / inv
        scaled = torch.where(wl > lo_wl, inv / factor, inv)
        smooth = (old / wl - lo) / (hi - lo)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wl >= hi_wl) & (wl <= lo_wl)
        return torch.where(is_mid, mid, scaled), 1.0
    if kind == "yarn":
        factor = scaling.factor
        old = scaling.original_max_position_embeddings
        beta_fast, beta_slow = scaling.beta_fast or 32.0, scaling.beta_slow or 1.0

        def mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if scaling.mscale is not None and scaling.mscale_all_dim is not None:
            att = mscale(factor, scaling.mscale) / mscale(factor, scaling.mscale_all_dim)
        else:
            att = mscale(factor)

        def corr(rot):
            return (dim * math.log(old / (rot * 2 * math.pi))) / (2 * math.log(theta))

        low, high = corr(beta_fast), corr(beta_slow)
        if scaling.truncate is not False:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        inv = (inv / factor) * (1 - extrapolation) + inv * extrapolation
        return inv, att
    raise ValueError(f"unsupported rope_type {kind!r}")


def rope_cos_sin(positions: torch.Tensor, dim: int, theta: float, scaling, dtype):
    inv, att = rope_inv_freq(dim, theta, scaling)
    freqs = positions.to(torch.float64)[:, None] * inv.to(positions.device)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * att).to(dtype), (emb.sin() * att).to(dtype)


def mrope_rows(section, dim: int, interleaved: bool = False) -> torch.Tensor:
    """[dim]: which position row (0 temporal, 1 height, 2 width) rotates each column of the
    rotate-half layout: the frequencies split by ``section``, in turn (Qwen2-VL, Qwen2.5-VL), or
    ``interleaved`` (Qwen3-VL: frequency j takes the height where j % 3 == 1 and j < 3 x
    section[1], the width where j % 3 == 2 and j < 3 x section[2], else the temporal position),
    repeated for both halves."""
    if sum(section) != dim // 2:
        raise ValueError(f"mrope_section {list(section)} sums to {sum(section)}, not head_dim / 2 = {dim // 2}")
    if interleaved:
        j = torch.arange(dim // 2)
        which = torch.zeros(dim // 2, dtype=torch.long)
        for row in (1, 2):
            which[(j % 3 == row) & (j < 3 * section[row])] = row
    else:
        which = torch.repeat_interleave(torch.arange(len(section)) % 3, torch.tensor(list(section)))
    return torch.cat([which, which])


def mrope_cos_sin(positions: torch.Tensor, dim: int, theta: float, scaling, section, dtype,
                  interleaved: bool = False):
    """M-RoPE (Qwen2-VL / Qwen2.5-VL; ``interleaved``: Qwen3-VL): ``positions`` [3, T]
    (temporal, height, width); the rotary frequencies split by ``section`` (summing to dim / 2)
    rotate by the temporal, height and width position (:func:`mrope_rows`), as HF's multimodal
    rotary embedding does. Equal rows (text) give ``rope_cos_sin`` of that row."""
    inv, att = rope_inv_freq(dim, theta, scaling)
    freqs = positions.to(torch.float64)[:, :, None] * inv.to(positions.device)[None, None, :]  # [3, T, dim/2]
    which = mrope_rows(section, dim, interleaved)[: dim // 2]
    f = freqs.gather(0, which.to(positions.device)[None, None, :].expand(1, freqs.shape[1], -1))[0]
    emb = torch.cat([f, f], dim=-1)
    return (emb.cos() * att).to(dtype), (emb.sin() * att).to(dtype)


def rotate_half_matrix(dim: int) -> torch.Tensor:
    """``m`` [dim, dim] with ``x @ m == rotate_half(x)``: what the ttnn lowering multiplies by
    where its rotary kernel does not take the head dim (Qwen2.5-VL-7B's vision heads are 80)."""
    m = torch.zeros(dim, dim)
    h = dim // 2
    m[torch.arange(h, dim), torch.arange(h)] = -1.0
    m[torch.arange(h), torch.arange(h, dim)] = 1.0
    return m


def pool_matrix(images: int, side: int, window: int) -> torch.Tensor:
    """The average pool as a matrix ``[images * (side / window)^2, images * side^2]`` (row-major
    patches and soft tokens, image after image): what the ttnn lowering multiplies by."""
    out = side // window
    m = torch.zeros(images * out * out, images * side * side)
    for i in range(images):
        for r in range(side):
            for c in range(side):
                m[i * out * out + (r // window) * out + c // window, i * side * side + r * side + c] = 1.0 / window ** 2
    return m
