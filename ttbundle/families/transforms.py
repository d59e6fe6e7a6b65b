"""Named pure transforms from Hugging Face checkpoint tensors to ttbundle's canonical tensors.

Each transform takes the list of source tensors (one per key in ``HFName.hf``; ``{e}`` keys give
one per expert, already stacked on a new dim 0 by the loader) and the arch, and returns the
canonical tensor. Families refer to them by name in ``HFName.transform``.
"""

from __future__ import annotations

from typing import Callable


def transpose(src, a):
    """HF Linear weight [out, in] -> device [in, out] (experts: [E, out, in] -> [E, in, out])."""
    return src[0].transpose(-1, -2).contiguous()


def identity(src, a):
    return src[0]


TRANSFORMS: dict[str, Callable] = {
    "t": transpose,
    "id": identity,
}


def register(name: str, fn: Callable) -> None:
    if name in TRANSFORMS:
        raise ValueError(f"transform {name!r} registered twice")
    TRANSFORMS[name] = fn


def apply(name: str, src: list, a):
    try:
        fn = TRANSFORMS[name]
    except KeyError:
        raise KeyError(f"unknown transform {name!r}; known: {', '.join(TRANSFORMS)}") from None
    return fn(src, a)
