"""Program ops -> ttnn calls: the per-device program of one (phase, bucket) as a :class:`Forward`.

Input: the typed program (``program.Program``) ``lower.lower`` writes into a package (per layer
kind, every op with its per-device shapes, every collective with its mesh axes) and the ``Mesh``
it runs on. Output: for every layer (in order, with its own index for weights and KV caches) the
ttnn calls that compute it, the device inputs a run writes first, the setup calls a model runs
once, the host-made constants and the weights as ttnn holds them. One small function per op
kind, in :data:`OPS` (the coverage test requires an entry for every kind the families' programs
use), split as the emulated kernels are:

* :mod:`.emitter` — the lowerer of one program, the 4-D shape convention, setup weight views;
* :mod:`.text_ops` — embedding, norms, matmuls, rope, attention, MLP, residual, the head;
* :mod:`.moe_ops` — DeepSeek's MLA and the mixture-of-experts ops;
* :mod:`.vision` — one module per vision encoder, named after its family (``vision/gemma3.py``,
  ``qwen2_5_vl``, ``qwen3_vl`` with DeepStack, ``mistral3``), registered in :data:`ENCODERS`;
* :mod:`.mesh_ops` — collectives and partitions;
* :mod:`.inputs` — the forward's input declarations and MLA's static chunk starts.

This module re-exports the names callers use from those.
"""

from __future__ import annotations

from typing import Callable

from ... import layout  # noqa: F401  (tests mutate layout's gather order through lowering.layout)
from ...mesh import Mesh
from ...program import Op, Program, Step
from . import configs, mesh_ops, moe_ops, text_ops
from .calls import Forward, Layer, T
from .feed import add_feed
from .emitter import DECODE_LIKE, DRAM, SAMPLING, TOPK, Lowerer, program_policy, samplings, tt_dim, tt_shape
from .inputs import (chunk_starts, image_mask, image_prefill, inputs_of, mask_input, merge_images,
                     mrope_position_input, static_prefill_start, static_start, vision_mask_input,
                     VISION_HOST_INPUTS)
from .layout import TILE, device_shape
from .mesh_ops import collective_calls, partition_calls
from .vision import _common, gemma3, mistral3, qwen2_5_vl, qwen3_vl


def _table(*parts: dict) -> dict:
    """The op modules' tables as one; a kind two modules lower is refused."""
    out: dict = {}
    for part in parts:
        twice = set(out) & set(part)
        if twice:
            raise ValueError(f"ttnn op kinds lowered twice: {sorted(twice)}")
        out.update(part)
    return out


#: family name -> the module of its vision encoder's lowerings (``vision/<family name>.py``)
ENCODERS = {m.__name__.rpartition(".")[2]: m for m in (gemma3, mistral3, qwen2_5_vl, qwen3_vl)}
OPS: dict[str, Callable[[Lowerer, Step], None]] = _table(text_ops.OPS, moe_ops.OPS, _common.OPS,
                                                            *(m.OPS for m in ENCODERS.values()), mesh_ops.OPS)


def step_kind(st: Step) -> str:
    """The name a step's op is lowered by (:data:`OPS`): a local op's kernel, else the op."""
    return st.kernel if st.op is Op.LOCAL else st.op.value


def unlowered_ops(program: Program) -> list[str]:
    """The op kinds of ``program`` that have no ttnn lowering (in :data:`OPS`), in order."""
    kinds = [step_kind(st) for lp in program.layers for st in lp.steps]
    return list(dict.fromkeys(k for k in kinds if k not in OPS))


def lower_forward(bundle, mesh: Mesh, program: Program, sampling: str = "device",
                  grid: tuple[int, int] | None = None, chunk_start: int = 0) -> Forward:
    """The ttnn calls of ``program`` (the typed ``program.Program`` of one phase and bucket, as
    ``lower.lower`` made it and a package holds it: ``LoadedPackage.program_ir``) on ``mesh``
    (the ``Mesh`` it runs on). Every weight's PartitionSpec, per-device shape and dtype, the KV
    cache's dtype and block size come from the program, nothing from a plan; a program for another
    mesh shape is refused. ``grid``: the compute grid to configure ops for (default: the mesh
    chip's); ``chunk_start``: the static chunk start of an MLA prefill (:func:`chunk_starts`)."""
    if sampling not in SAMPLING:
        raise ValueError(f"sampling must be one of {SAMPLING}, got {sampling!r}")
    if not isinstance(program, Program):
        raise TypeError(f"lower_forward takes a program.Program, got {type(program).__name__}")
    if sampling not in samplings(program.phase):
        raise ValueError(f"a {program.phase} forward is lowered with sampling {samplings(program.phase)}, "
                         f"got {sampling!r}: its rows' logits come back for acceptance on the host")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"lower_forward takes the mesh.Mesh the program runs on, got {type(mesh).__name__}")
    name = program.name
    shape = list(program.mesh.get("shape", ()))
    if shape != list(mesh.shape):
        raise ValueError(f"program {name} is for a {shape} mesh, lowering for {mesh.describe()}")
    lw = Lowerer(bundle, mesh, program, sampling, grid)
    lw.chunk_start = int(chunk_start)
    lw.inputs = inputs_of(program, bundle)
    if program.phase == "vision":
        lw.shapes["patches"] = lw.inputs["patches"][0]
    layers: list[Layer] = []
    index = 0
    deep: list[str] = []  # Qwen3-VL: each DeepStack merger's output, returned beside the soft tokens
    for lp in program.layers:
        decoder = (lp.kind not in ("embedding", "head", "vision_embedding", "vision_projector")
                   and not lp.kind.startswith("vision_deepstack"))
        for i in range(lp.count if decoder else 1):
            lw.layer = index if decoder else None
            lw.calls = []
            if lp.kind == "head" and program.phase == "prefill":
                # the head runs on the tile row holding the last prompt token: a [32, rows]
                # selector (an input, one-hot rows) picks it, so the trace needs no dynamic slice
                h = lw.shapes["h"]
                lw.op = "logits"
                lw.call("matmul", T("last_rows"), T("h"), out="h", shape=(1, 1, min(TILE, h[2]), h[3]),
                        memory_config=DRAM, compute_kernel_config=configs.compute_config())
            for st in lp.steps:
                k = step_kind(st)
                fn = OPS.get(k)
                if fn is None:
                    raise NotImplementedError(f"no ttnn lowering for program op {k!r}")
                lw.op = k
                fn(lw, st)
            if lp.kind == "embedding" and "mm_keep" in lw.inputs:
                merge_images(lw)
            if lp.kind.startswith("vision_deepstack"):  # its output "deep", kept under a name of its own
                out = lp.steps[-1].out.name
                deep.append(lw.call("reshape", T(out), list(lw.shapes[out]), out=f"{out}.{len(deep)}",
                                    shape=lw.shapes[out]))
            if lp.kind == "vision_projector" and deep:  # [soft tokens, (1 + sets) x hidden]
                out = lp.steps[-1].out.name
                s = lw.shapes[out]
                lw.call("concat", [T(out)] + [T(d) for d in deep], 3, out=f"{out}.deep",
                        shape=(*s[:3], s[3] * (1 + len(deep))), memory_config=DRAM)
            layers.append(Layer(lp.kind, lw.layer, lw.calls))
            index += 1 if decoder else 0
    outputs = ["next_tokens"] if sampling == "device" else ["logits.out"]
    if program.phase == "vision":  # the soft tokens (and DeepStack's features beside them), replicated
        outputs = [program.layers[-1].steps[-1].out.name + (".deep" if deep else "")]
    elif sampling == "host":
        for k in ("top_k", "top_p", "temperature"):
            lw.inputs.pop(k)
    weights = {n: (tuple(device_shape(t.device_shape, t.layout)), t.dtype, t.layout) for n, t in lw.tensors.items()}
    fw = Forward(program.phase, program.bucket, program.rows, lw.inputs, layers, outputs,
                 list(lw.setup.values()), list(lw.consts.values()), lw.gaps, weights)
    if program.phase == "decode" and sampling == "device":  # the next decode's tokens from this one's ids
        fw = add_feed(fw)
    return fw


__all__ = ["DECODE_LIKE", "OPS", "SAMPLING", "TOPK", "chunk_starts", "collective_calls", "device_shape", "image_mask",
           "image_prefill", "inputs_of", "lower_forward", "mask_input", "mrope_position_input", "partition_calls",
           "program_policy", "samplings", "static_prefill_start", "static_start", "step_kind", "tt_dim", "tt_shape",
           "unlowered_ops", "vision_mask_input", "VISION_HOST_INPUTS"]
