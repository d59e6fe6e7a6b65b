"""``check``'s two verdicts and their bounds (docs/check.md).

**Executor** (a bug, at any storage and depth): the emulated mesh against the *expected* run,
transformers on the checkpoint stored as the package declares it (``check.expected``). Each stage
(the embedding, every decoder layer, the head, the image) is judged *locally*: the expected side
runs that stage on the emulated side's own input to it (its output of the stage before), so the
two differ only by that stage's arithmetic, whatever the depth, and a stage's error does not
carry into the next one's verdict. The metric is the stage's **normalised error**: the error of
its output relative to what the stage itself changed (its output minus its input: the layer's
update of the residual stream; for the embedding and the head, their output), per channel (per
hidden feature; per vocabulary entry for the head), each channel scaled by the larger of its own
update and the median channel's, then the root mean square over channels. A few massive
residual channels (|x| ~ 1,000 in trained models) therefore weigh as one channel each, not as
the whole stream, and an ordinary channel's error is measured against an ordinary channel's
size. The bounds depend on the compute dtype and the stage kind, not on the storage (both sides
hold the same stored values) nor the depth (nothing accumulates across local stages).

**Quality** (a choice of storage, statistical): the package's next-token distributions against
the original checkpoint's over the same text (``check.quality``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: the executor bound on a stage's normalised error, per compute dtype (measured: docs/check.md,
#: "Executor bounds"; the worst correct stage of every family, mesh and storage and the smallest
#: mutation are printed by benches/check_figures.py)
EXEC_BOUNDS = {"fp32": 1e-3, "bf16": 0.06}
#: the head's (the final norm and the LM head: one matmul from the same input, no residual): its
#: own, tighter bound; the decisive margin is counted in it
HEAD_BOUNDS = {"fp32": 1e-3, "bf16": 0.02}
#: MoE: the positions whose token took other experts on the two sides in a layer (a router
#: near-tie rounded apart, on the same input: another expert is another function) are judged
#: apart in that layer's stage, against this bound; the stage's other positions, and every other
#: stage, keep theirs. In bf16 every such position; in fp32 only a tie (:func:`router_tie`). A
#: token's MoE output with one of its experts swapped is about as far from the expected one as
#: the update is large (measured 0.7-1.0 on the tests' GPT-OSS and DeepSeek; two unrelated
#: vectors of one size: sqrt(2))
FLIP_BOUND_BF16 = 1.5
#: fp32: two router logits closer than this, relative to the row's logit rms, are a tie that the
#: summation order of a correct router GEMM decides (the same dot product summed in another
#: order moves a logit by ~2**-24 x sqrt(K) of its scale at most: 5e-6 at K = 7,168). Measured: the
#: tiny Qwen3 MoE of tests/test_check_qwen3_moe.py on T3K took another third-choice expert for
#: one of 2,044 choices on an AMD EPYC host, its two logits 1.4e-6 apart (rms ~1); a bug moves
#: logits by O(1) and is never a tie
FP32_TIE = 2.0 ** -14


def router_tie(logits, expected: set, emulated: set) -> bool:
    """Whether one token's two expert choices differ only by a tie (fp32): every expert one side
    chose and the other did not has a logit (the expected router's, ``logits`` [E]) within
    :data:`FP32_TIE` x the row's rms of every expert the other side chose instead."""
    a, b = sorted(expected - emulated), sorted(emulated - expected)
    if not a or len(a) != len(b):
        return False
    rms = float(logits.double().pow(2).mean().sqrt())
    gap = float((logits[a][:, None].double() - logits[b][None, :].double()).abs().max())
    return gap <= FP32_TIE * rms
#: a position is decisive when the expected side's top-1 logit leads its top-2 by more than this
#: many allowed logit errors (the head's bound times the position's logit standard deviation):
#: a prediction the executor's own allowance cannot flip (flipping it takes the two logits'
#: errors, each within the bound, to differ by the margin)
MARGIN_SIGMAS = 3.0
#: fewer decisive positions than this cannot pass: predictions that rounding could flip prove
#: nothing (a longer --prompt-len, more --steps or natural --text give more)
MIN_DECISIVE = 8
STAGE_ORDER = {"image": 0, "embed": 1, "layer": 2, "head": 3}


#: the relative resolution of a value held in the compute dtype (half its unit in the last place
#: at most: bf16 keeps 8 significant bits)
RESOLUTION = {"fp32": 2.0 ** -24, "bf16": 2.0 ** -8}
#: a channel's error is measured against at least this many units of the resolution of its
#: output: where a layer's update is small next to the residual it is added to, a bf16 residual
#: cannot hold the update more finely, and two correct bf16 computations whose updates differ
#: in the last bits round the sum one unit apart (measured: the demo model's decode steps at a
#: 683-token context, docs/check.md)
RESOLUTION_UNITS = 8


def normalised_error(ref, emu, inp=None, dtype: str = "fp32") -> float:
    """The stage metric (module docstring): ``ref``/``emu`` the two sides' outputs and ``inp``
    the input both read ``[positions, channels]`` (None: the update is the output). Each
    channel's error is scaled by the largest of its update, the median channel's update and
    :data:`RESOLUTION_UNITS` units of the compute dtype's resolution of its output."""
    import torch

    r = ref.double().reshape(-1, ref.shape[-1])
    e = emu.double().reshape(-1, emu.shape[-1]) - r
    u = r if inp is None else r - inp.double().reshape(-1, inp.shape[-1])
    un, en = u.norm(dim=0), e.norm(dim=0)
    floor = un.median().clamp(min=torch.finfo(torch.float64).tiny)
    held = RESOLUTION_UNITS * RESOLUTION[dtype] * r.norm(dim=0)
    return float(((en / torch.maximum(torch.maximum(un, floor), held)) ** 2).mean().sqrt())


def pcc(a, b) -> float:
    import torch

    a, b = a.double().flatten(), b.double().flatten()
    a, b = a - a.mean(), b - b.mean()
    den = (a.norm() * b.norm()).item()
    if den == 0:
        return 1.0 if torch.equal(a, b) else 0.0
    return float((a @ b).item() / den)


@dataclass
class Stage:
    """One stage of one step, emulated against expected (local): ``err`` the normalised error."""

    step: str  # "prefill", "decode N" or "image"
    layer: int  # decoder layer; the embedding's is -1, the head's the number of decoder layers
    stage: str  # "embed", "layer", "head" or "image"
    err: float
    max_abs: float
    pcc: float
    #: MoE: positions whose token took other experts on the two sides in this layer (bf16: any;
    #: fp32: a :func:`router_tie`), excluded from ``err``, and their own normalised error (at
    #: most FLIP_BOUND_BF16)
    flipped: int = 0
    flip_err: float | None = None

    @property
    def name(self) -> str:
        return f"layer {self.layer}" if self.stage == "layer" else self.stage


@dataclass
class Executor:
    """The executor verdict's evidence (module docstring)."""

    dtype: str
    stages: list = field(default_factory=list)
    #: per compared position: the expected side's and the emulated side's predictions, the
    #: expected margin (top-1 minus top-2 logit) and the allowed margin (decisive above it)
    exp_tokens: list = field(default_factory=list)
    emu_tokens: list = field(default_factory=list)
    margins: list = field(default_factory=list)
    margin_bounds: list = field(default_factory=list)
    #: MoE: the (step, layer) pairs where a token took other experts on the two sides (same input)
    flips: list = field(default_factory=list)
    routing: dict | None = None

    @property
    def bound(self) -> float:
        return EXEC_BOUNDS[self.dtype]

    @property
    def decisive(self) -> list[int]:
        return [p for p, (m, b) in enumerate(zip(self.margins, self.margin_bounds)) if m > b]

    @property
    def tokens_agree(self) -> bool:
        return all(self.exp_tokens[p] == self.emu_tokens[p] for p in self.decisive)

    def allowed(self, s: Stage) -> float:
        return HEAD_BOUNDS[self.dtype] if s.stage == "head" else self.bound

    def stage_ok(self, s: Stage) -> bool:
        return s.err <= self.allowed(s) and (s.flip_err is None or s.flip_err <= FLIP_BOUND_BF16)

    @property
    def enough_decisive(self) -> bool:
        return len(self.decisive) >= MIN_DECISIVE

    @property
    def passed(self) -> bool:
        return bool(self.stages) and all(map(self.stage_ok, self.stages)) and self.tokens_agree \
            and self.enough_decisive

    def first_wrong(self) -> Stage | None:
        """The first stage over its bound (execution order: image, then per step the embedding,
        layers and head), or None (a differing decisive prediction is named by :meth:`failure`)."""
        return next((s for s in self.stages if not self.stage_ok(s)), None)

    def failure(self, step_of) -> str | None:
        """Why the verdict fails, in one line; None when it passes."""
        bad = self.first_wrong()
        if bad is not None:
            if bad.err <= self.allowed(bad):
                return (f"{bad.name} at {bad.step}: the {bad.flipped} position(s) routed to other experts "
                        f"than the expected run's have normalised error {bad.flip_err:.3g} > "
                        f"{FLIP_BOUND_BF16:g} (router near-ties)")
            return (f"{bad.name} at {bad.step}: normalised error {bad.err:.3g} against the expected run "
                    f"(the checkpoint as this package stores it) > {self.allowed(bad):g} "
                    f"({self.dtype} compute)")
        wrong = next((p for p in self.decisive if self.exp_tokens[p] != self.emu_tokens[p]), None)
        if wrong is not None:
            return (f"head at {step_of(wrong)}: the next-token prediction differs from the expected run's "
                    f"({self.emu_tokens[wrong]} vs {self.exp_tokens[wrong]}) where its margin "
                    f"{self.margins[wrong]:.3g} exceeds what the {self.dtype} bound can move "
                    f"({self.margin_bounds[wrong]:.3g})")
        if not self.enough_decisive:
            return (f"only {len(self.decisive)} of {len(self.margins)} compared predictions are decisive "
                    f"(at least {MIN_DECISIVE} needed: a near-tie proves nothing); give natural text "
                    f"(--text), a longer --prompt-len or more --steps, or check with --dtype fp32")
        if not self.stages:
            return "no stage was compared"
        return None

    def to_json(self, step_of) -> dict:
        bad = self.first_wrong()
        return {"passed": self.passed, "failure": self.failure(step_of), "dtype": self.dtype,
                "bound": self.bound, "head_bound": HEAD_BOUNDS[self.dtype], "flip_bound": FLIP_BOUND_BF16,
                "fp32_tie": FP32_TIE if self.dtype == "fp32" else None,
                "metric": "normalised error (docs/check.md)",
                "first_wrong": None if bad is None else {"step": bad.step, "stage": bad.stage,
                                                         "layer": bad.layer, "err": bad.err},
                "stages": [dict(s.__dict__, allowed=self.allowed(s)) for s in self.stages],
                "decisive_positions": len(self.decisive), "min_decisive": MIN_DECISIVE,
                "tokens_agree": self.tokens_agree, "expected_tokens": self.exp_tokens,
                "emulated_tokens": self.emu_tokens, "margins": self.margins,
                "margin_bounds": self.margin_bounds, "flips": [list(f) for f in self.flips],
                "routing": self.routing}
