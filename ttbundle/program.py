"""The program IR: the static per-device program of one (phase, bucket), as typed data.

``lower.lower`` produces a :class:`Program`; ``build`` serializes it into the package
(``programs/<phase>-<bucket>.json``, :meth:`Program.to_json`); the emulated backend executes the
package's programs as they are (:meth:`Program.from_json`) and the ttnn lowering translates them
op by op. Nothing downstream of ``lower`` re-derives a program from the spec.

A program is a list of *layer programs* (embedding, each decoder layer kind with its repeat
count, head), each a list of :class:`Step`: an op (:class:`Op`) reading named
:class:`Activation` values (per-device shape, dtype, and how each feature dim is split over the
mesh axes) and weights, or a collective (``all_reduce`` / ``all_gather``) on one activation.
Every weight a program reads is listed with its PartitionSpec and per-device shape
(:class:`WeightRef`), so an executor needs the program and the weight shards, no plan.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field

from .families.base import Dim
from .traits import Dims, LayerTraits, Traits, TraitsError

# /3: the family's traits recorded (``traits``, ``layer_traits``); /4: the model's dims and
# max_model_len (``dims``), so executors read no bundle.yaml arch; older programs are refused
FORMAT = "ttbundle.program/4"


class ProgramError(ValueError):
    """A serialized program that is not a valid program of this format."""


class Op(str, enum.Enum):
    EMBEDDING = "embedding"
    RMS_NORM = "rms_norm"
    MATMUL = "matmul"
    LOCAL = "local"  # per-device compute: ``kernel`` names it (attention, swiglu, routing, ...)
    COMBINE = "combine"
    RESIDUAL_ADD = "residual_add"
    LOGITS = "logits"
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"

    @property
    def collective(self) -> bool:
        return self in (Op.ALL_REDUCE, Op.ALL_GATHER)


Spec = tuple[tuple[str, ...], ...]  # per feature dim: the mesh axes it is split over


def _spec(x) -> Spec:
    return tuple(tuple(e) for e in (x or ()))


@dataclass(frozen=True)
class Activation:
    """A named per-device activation: ``[rows, *features]`` with each feature dim's axes."""

    name: str
    shape: tuple[int, ...]
    spec: Spec = ()
    dtype: str = "bf16"


@dataclass(frozen=True)
class WeightRef:
    """A weight a program reads: its PartitionSpec (one entry per dim), per-device shape, dtype."""

    name: str
    spec: Spec
    device_shape: tuple[int, ...]
    dtype: str
    layers: tuple[int, int] | None = None


@dataclass(frozen=True)
class Step:
    op: Op
    ins: tuple[Activation, ...] = ()
    out: Activation | None = None
    w: str | None = None
    kernel: str = ""  # Op.LOCAL: which kernel
    what: str = ""
    axes: tuple[str, ...] = ()  # collectives
    dim: int | None = None  # all_gather: the activation dim gathered (0 = rows)
    feature: Dim | None = None  # all_gather: the gathered feature dim (padding/replicas undone)
    devices: int = 1
    payload_bytes: int = 0
    traffic_bytes: int = 0
    flops: int = 0

    @property
    def act(self) -> str:
        """The activation a collective works on."""
        return self.ins[0].name


@dataclass(frozen=True)
class LayerProgram:
    kind: str  # "embedding", a layer kind's name, "head"
    count: int
    steps: tuple[Step, ...]


@dataclass(frozen=True)
class Program:
    bundle: str
    family: str
    mesh: dict  # {"name", "shape", "arch"}
    phase: str
    bucket: int
    rows: int
    context: int
    traced: bool
    trace_region_bytes: int
    kv_cache: dict
    totals: dict
    memory: dict
    layers: tuple[LayerProgram, ...]
    weights: dict[str, WeightRef] = field(default_factory=dict)
    policy: dict = field(default_factory=dict)  # the sharding policy for padded/replicated dims
    #: the numerics beyond shapes (``ttbundle.traits``): the model's, and each decoder layer's
    traits: Traits = field(default_factory=Traits)
    layer_traits: tuple[LayerTraits, ...] = ()
    #: the model's sizes beyond the steps' shapes (``traits.Dims``: hidden, vocab, layers, KV
    #: heads and head width, RMSNorm eps, max_model_len)
    dims: Dims | None = None
    #: a verify program (speculative decoding): rows of one sequence, its last token and the k
    #: proposals (``speculative.rows_per_seq``); 0 for the other phases
    rows_per_seq: int = 0

    @property
    def name(self) -> str:
        return program_name(self.phase, self.bucket)

    def steps(self):
        """(layer kind, step index, step) for every step, in order."""
        for lp in self.layers:
            for i, st in enumerate(lp.steps):
                yield lp.kind, i, st

    def verify(self, where: str | None = None) -> None:
        """The program type-checked as an executor would run it (:func:`verify`)."""
        verify(self, where)

    # -- JSON ---------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "format": FORMAT, "bundle": self.bundle, "family": self.family, "mesh": dict(self.mesh),
            "phase": self.phase, "bucket": self.bucket, "rows": self.rows, "context": self.context,
            "traced": self.traced, "trace_region_bytes": self.trace_region_bytes,
            "kv_cache": self.kv_cache, "totals": self.totals, "memory": self.memory,
            "policy": self.policy,
            "traits": self.traits.to_json(), "layer_traits": [lt.to_json() for lt in self.layer_traits],
            "dims": None if self.dims is None else self.dims.to_json(),
            **({"rows_per_seq": self.rows_per_seq} if self.phase == "verify" else {}),
            "weights": {n: {"spec": [list(e) for e in w.spec], "device_shape": list(w.device_shape),
                            "dtype": w.dtype, "layers": None if w.layers is None else list(w.layers)}
                        for n, w in sorted(self.weights.items())},
            "layers": [{"kind": lp.kind, "count": lp.count, "steps": [_step_json(s, self.weights)
                                                                      for s in lp.steps]}
                       for lp in self.layers],
        }

    @classmethod
    def from_json(cls, d: dict, where: str = "program") -> "Program":
        try:
            if d.get("format") != FORMAT:
                raise ProgramError(f"format {d.get('format')!r}, expected {FORMAT!r}")
            weights = {n: WeightRef(n, _spec(w["spec"]), tuple(w["device_shape"]), w["dtype"],
                                    None if w["layers"] is None else tuple(w["layers"]))
                       for n, w in d["weights"].items()}
            layers = tuple(LayerProgram(lp["kind"], int(lp["count"]),
                                        tuple(_step_from(s, f"{where}: {lp['kind']} step {i}")
                                              for i, s in enumerate(lp["steps"])))
                           for lp in d["layers"])
            return cls(d["bundle"], d["family"], d["mesh"], d["phase"], int(d["bucket"]), int(d["rows"]),
                       int(d["context"]), bool(d["traced"]), int(d["trace_region_bytes"]), d["kv_cache"],
                       d["totals"], d["memory"], layers, weights, d.get("policy", {}),
                       Traits.of(d["traits"], "traits"), _layer_traits(d["layer_traits"]),
                       Dims.of(d["dims"], "dims"), _rows_per_seq(d))
        except (ProgramError, TraitsError) as e:
            raise ProgramError(f"{where}: {e}") from None
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ProgramError(f"{where}: not a valid {FORMAT} program ({type(e).__name__}: {e})") from None


def _rows_per_seq(d: dict) -> int:
    """A verify program's rows per sequence (recorded since the runtime stopped re-reading the spec)."""
    if d["phase"] != "verify":
        return 0
    if "rows_per_seq" not in d:
        raise ProgramError("a verify program without rows_per_seq (written by an older ttbundle); rebuild the package")
    n = d["rows_per_seq"]
    if not isinstance(n, int) or isinstance(n, bool) or n < 2:
        raise ProgramError(f"rows_per_seq {n!r}: a verify program has 2 or more rows per sequence")
    return n


def program_name(phase: str, bucket: int) -> str:
    """A program's name in a package (``programs/<name>.json``, artifact keys, the manifest's
    ``precompiled.programs``): ``<phase>-<bucket>``."""
    return f"{phase}-{bucket}"


def _layer_traits(items) -> tuple[LayerTraits, ...]:
    """Each layer's traits; layers with equal traits share one record (as ``lower``'s share the
    arch's rope scaling), so an executor caching per record (rope tables) computes them once."""
    seen: dict[str, LayerTraits] = {}
    out = []
    for i, lt in enumerate(items):
        key = json.dumps(lt, sort_keys=True, default=str)
        if key not in seen:
            seen[key] = LayerTraits.of(lt, f"layer_traits[{i}]")
        out.append(seen[key])
    return tuple(out)


# ---- the verifier ----------------------------------------------------------------------------------
#: what a layer program starts from: the running hidden state, and the embedding's / a vision
#: encoder's inputs (``EmulatedModel.forward`` / ``encode_images`` give exactly these)
ENTRY = ("h", "tokens", "patches")


def verify(program: "Program", where: str | None = None) -> None:
    """Type-check ``program`` like MLIR's verifier: walking its steps in order, every step's
    inputs must be values the earlier steps produced (or the layer program's entry values,
    :data:`ENTRY`), with the per-device features, split and dtype the step declares; a
    collective's result is what it makes of its input (an all_reduce keeps the shape, an
    all_gather multiplies the gathered dim back to the feature's size, dropping its axes); a
    weight a step reads must be listed. Mesh axes of size 1 split nothing and are ignored. Rows
    may change only at a layer program's start (the head runs on the prefill's last rows).
    The traits must fit the steps: one :class:`LayerTraits` per decoder layer the layer programs
    run, and a norm's bias (``traits.norms``) a weight the program lists.
    Raises :class:`ProgramError` naming the program, layer program and step."""
    shape = tuple(program.mesh.get("shape") or ())
    sizes = {"rows": shape[0] if shape else 1, "cols": shape[1] if len(shape) > 1 else 1}
    name = where or program.name
    _verify_traits(program, name)

    def norm(spec) -> Spec:
        return tuple(tuple(a for a in e if sizes.get(a, 2) > 1) for e in spec)

    def show(v: Activation) -> str:
        split = ", ".join(f"dim {i + 1} over {'x'.join(e)}" for i, e in enumerate(norm(v.spec)) if e)
        return f"{list(v.shape)} {v.dtype}" + (f" split ({split})" if split else " replicated")

    env: dict[str, Activation] = {}
    for lp in program.layers:
        at_start = True
        for i, st in enumerate(lp.steps):
            here = f"{name}: {lp.kind} step {i} ({st.kernel or st.op.value})"
            for a in st.ins:
                have = env.get(a.name)
                if have is None:
                    if a.name in ENTRY and at_start:
                        continue
                    if a.name in ENTRY and a.name not in env:
                        continue
                    raise ProgramError(f"{here}: reads {a.name!r}, which no earlier step produces")
                rows_ok = have.shape[:1] == a.shape[:1] or a.name in ENTRY and lp.kind in ("head",)
                if have.shape[1:] != a.shape[1:] or norm(have.spec) != norm(a.spec) or \
                        have.dtype != a.dtype or not rows_ok:
                    hint = " (a collective missing or extra before it?)" if have.shape != a.shape or \
                        norm(have.spec) != norm(a.spec) else ""
                    raise ProgramError(f"{here}: reads {a.name!r} as {show(a)}, but the steps before "
                                       f"leave it {show(have)}{hint}")
            if st.w is not None and st.w not in program.weights:
                raise ProgramError(f"{here}: reads weight {st.w!r}, which the program does not list")
            if st.op.collective:
                a = env.get(st.act) or st.ins[0]
                if st.op is Op.ALL_REDUCE:
                    env[a.name] = a
                else:
                    d = st.dim if st.dim is not None else len(a.shape) - 1
                    if not 0 <= d < len(a.shape):
                        raise ProgramError(f"{here}: gathers dim {d} of {a.name!r} {list(a.shape)}")
                    size = st.feature.length if st.feature is not None else a.shape[d] * max(st.devices, 1)
                    spec = list(a.spec) + [()] * (len(a.shape) - 1 - len(a.spec))
                    if d >= 1:
                        spec[d - 1] = tuple(x for x in spec[d - 1] if x not in st.axes)
                    env[a.name] = Activation(a.name, a.shape[:d] + (size,) + a.shape[d + 1:], tuple(spec), a.dtype)
            elif st.out is not None:
                env[st.out.name] = st.out
            at_start = False


def _verify_traits(program: "Program", name: str) -> None:
    if program.phase != "vision":
        decoder = sum(lp.count for lp in program.layers if lp.kind not in ("embedding", "head"))
        if len(program.layer_traits) != decoder:
            raise ProgramError(f"{name}: records traits for {len(program.layer_traits)} decoder layers, but its "
                               f"layer programs run {decoder}")
        if program.dims is not None and program.dims.num_hidden_layers != decoder:
            raise ProgramError(f"{name}: its dims say {program.dims.num_hidden_layers} decoder layers, but its "
                               f"layer programs run {decoder}")
    for kind, i, st in program.steps():
        how = program.traits.norms.get(st.w) if st.op is Op.RMS_NORM else None
        if how is not None and how.bias is not None and how.bias not in program.weights:
            raise ProgramError(f"{name}: {kind} step {i} (rms_norm): the traits give norm {st.w!r} the bias "
                               f"{how.bias!r}, which the program does not list")


# The JSON form (the package's files; executors read the typed program back): ops under "op" (a LOCAL op under its
# kernel's name), collectives under "collective"; "x"/"in_shape" for one input, "ins"/"in_shapes"
# for several, "out"/"out_shape"/"out_spec", "w"/"w_shape"/"w_dtype".
_ONE_INPUT = (Op.EMBEDDING, Op.RMS_NORM, Op.MATMUL, Op.COMBINE, Op.RESIDUAL_ADD, Op.LOGITS)
_STRUCTURAL = {o.value: o for o in Op if o not in (Op.LOCAL,) and not o.collective}


def _act_json(a: Activation) -> dict:
    return {"name": a.name, "shape": list(a.shape), "spec": [list(e) for e in a.spec], "dtype": a.dtype}


def _act_from(d: dict) -> Activation:
    return Activation(d["name"], tuple(d["shape"]), _spec(d["spec"]), d.get("dtype", "bf16"))


def _step_json(s: Step, weights: dict) -> dict:
    if s.op.collective:
        a = s.ins[0]
        out = {"collective": s.op.value, "act": a.name, "axes": list(s.axes), "devices": s.devices,
               "shape": list(a.shape), "spec": [list(e) for e in a.spec],
               "dim": s.dim, "payload_bytes": s.payload_bytes, "traffic_bytes": s.traffic_bytes}
        if s.feature is not None:
            f = s.feature
            out["feature"] = {"name": f.name, "size": f.size, "unit": f.unit, "groups": f.groups}
        return out
    out = {"op": s.kernel if s.op is Op.LOCAL else s.op.value, "flops": s.flops,
           "inputs": [_act_json(a) for a in s.ins]}
    if s.op is Op.LOCAL:
        out.update(what=s.what, ins=[a.name for a in s.ins], in_shapes=[list(a.shape) for a in s.ins])
    elif s.ins:
        out.update(x=s.ins[0].name, in_shape=list(s.ins[0].shape))
    if s.w is not None or s.op is Op.RMS_NORM:
        out["w"] = s.w
    ref = weights.get(s.w)
    if ref is not None and s.op in (Op.EMBEDDING, Op.MATMUL):
        out.update(w_shape=list(ref.device_shape), w_dtype=ref.dtype)
    if s.op is Op.MATMUL and ref is not None:
        # the shape the matmul consumes: a replicated input meeting a split contraction dim is
        # cut to the device's part of it first (and experts to the device's experts)
        used = list(s.ins[0].shape)
        used[-1] = ref.device_shape[-2]
        if len(used) == 3 and len(ref.device_shape) == 3:
            used[1] = ref.device_shape[0]
        out["in_shape"] = used
    if s.out is not None:
        out.update(out=s.out.name, out_shape=list(s.out.shape), out_spec=[list(e) for e in s.out.spec],
                   out_act=_act_json(s.out))
    return out


def _step_from(d: dict, where: str) -> Step:
    if "collective" in d:
        try:
            op = Op(d["collective"])
        except ValueError:
            raise ProgramError(f"{where}: unknown collective {d['collective']!r}") from None
        if not op.collective:
            raise ProgramError(f"{where}: {d['collective']!r} is not a collective")
        f = d.get("feature")
        feature = None if f is None else Dim(f["name"], int(f["size"]), int(f["unit"]), int(f.get("groups", 0)))
        a = Activation(d["act"], tuple(d["shape"]), _spec(d.get("spec")))
        return Step(op, (a,), axes=tuple(d["axes"]), dim=d.get("dim"), feature=feature,
                    devices=int(d["devices"]), payload_bytes=int(d["payload_bytes"]),
                    traffic_bytes=int(d["traffic_bytes"]))
    name = d["op"]
    op = _STRUCTURAL.get(name, Op.LOCAL)
    ins = tuple(_act_from(a) for a in d["inputs"])
    out = _act_from(d["out_act"]) if "out_act" in d else None
    return Step(op, ins, out, w=d.get("w"), kernel=name if op is Op.LOCAL else "", what=d.get("what", ""),
                flops=int(d.get("flops", 0)))


__all__ = ["ENTRY", "FORMAT", "Activation", "LayerProgram", "Op", "Program", "ProgramError", "Step", "WeightRef", "program_name", "verify"]
