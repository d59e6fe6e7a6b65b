"""Every emulated kernel by the name a program's ``local`` step gives: the text kernels
(``kernels``), the mixture-of-experts ones (``moe_kernels``) and the vision encoders'
(``vision_kernels``). Each kernel module defines its kernels; this table alone collects them,
so no module registers itself into another by being imported.
"""

from __future__ import annotations

from . import kernels, moe_kernels, vision_kernels

_TABLES = (kernels.KERNELS, moe_kernels.MOE_KERNELS, vision_kernels.GEMMA_VISION_KERNELS,
           vision_kernels.QWEN_VISION_KERNELS, vision_kernels.QWEN3_VISION_KERNELS,
           vision_kernels.MISTRAL3_VISION_KERNELS)


def _collect(tables) -> dict:
    out: dict = {}
    for table in tables:
        for name, fn in table.items():
            if name in out:
                raise ValueError(f"kernel {name!r} registered twice")
            out[name] = fn
    return out


KERNELS = _collect(_TABLES)
