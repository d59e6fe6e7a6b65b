"""Every emulated kernel by the name a program's ``local`` step gives: the text kernels
(``kernels``), the mixture-of-experts ones (``moe_kernels``), those the vision encoders share
(``vision._common``) and each vision encoder's (``vision/<family>.py``, registered in
:data:`ENCODERS`). Each kernel module defines its kernels; this table alone collects them,
so no module registers itself into another by being imported, and a name two modules define is
refused.
"""

from __future__ import annotations

from . import kernels, moe_kernels
from .vision import _common, gemma3, mistral3, qwen2_5_vl, qwen3_vl

#: family name -> the module of its vision encoder's kernels (``vision/<family name>.py``)
ENCODERS = {m.__name__.rpartition(".")[2]: m for m in (gemma3, mistral3, qwen2_5_vl, qwen3_vl)}
_TABLES = (kernels.KERNELS, moe_kernels.MOE_KERNELS, _common.KERNELS, *(m.KERNELS for m in ENCODERS.values()))


def _collect(tables) -> dict:
    out: dict = {}
    for table in tables:
        for name, fn in table.items():
            if name in out:
                raise ValueError(f"kernel {name!r} registered twice")
            out[name] = fn
    return out


KERNELS = _collect(_TABLES)
