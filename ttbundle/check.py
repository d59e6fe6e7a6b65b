"""`ttbundle check`: a package's programs on the emulated mesh against Hugging Face transformers.

What is checked is what ships: the package's own programs (``programs/*.json``) executed on its
own weight bytes (bf16, or bfp8/bfp4 tiles decoded as ttnn decodes them), with its KV cache held
in its declared dtype. ``check SPEC`` builds the package into a temporary directory first. The
reference is transformers in float32 on the checkpoint the package was built from, its weights
rounded to bf16 (the package's finest storage) and, for a bf16 KV cache, its cache rounded to
bf16 on every write as the package's is.

Layer by layer, in bounded memory. Neither side ever holds the model: the emulated mesh reads one
layer's shards at a time from the package (``EmulatedModel.run_layer_major`` on a lazy model);
transformers is a skeleton on the ``meta`` device (``reference.LayerwiseModel``) whose recording
forward gives each decoder layer's arguments per call (masks, position embeddings), after which
each layer is read from the checkpoint, run over every call with its own cache, compared with the
emulated layer and freed; then the final norm and LM head (the "head" stage). Peak memory is a
fixed amount plus one layer (and the largest tensor, the embedding or LM head), whatever the
depth (``tests/test_check_memory.py``).

Teacher forcing with a fixed continuation. A layer-major run must know every step's input token
before layer 0 runs, so the decode steps are fed the prompt's own tokens again from its start
(:func:`continuation`), not a greedy token. Next-token predictions are compared at up to
:data:`MAX_PROMPT_POSITIONS` prompt positions (all of a short prompt; evenly spaced in a long one,
the first and last included: the prefill runs its head on those rows) and at each step. Per stage
(each decoder layer, over every position; the head: the logits of the compared positions) and
step: max-abs error and PCC of the prompt's positions together (``prefill``) and of each step's
(``decode N``).

Near-ties. Where the reference's top-1/top-2 logit margin is within what the package's numerics
move the logits, a differing prediction is rounding, not a bug. The bound is measured: the
typical logit error (the median over compared positions of the standard deviation over the
vocabulary of emulated minus reference logits) times ``MARGIN_SIGMAS``; a position with a larger
margin is decisive. Measured on the tests' tiny models (docs/check.md): every differing
prediction of a correct block-float package had a margin under 4.2 typical errors. A bug that
inflates the logit error widens the bound, so the stage PCC bounds, the head's included, are what
catch it.

Pass, bf16 storage: fp32 compute -> every decisive prediction identical and every stage's PCC >=
``PCC_MIN_FP32``; bf16 compute -> every stage's PCC >= ``PCC_MIN_BF16``. Block floats (bfp8/bfp4
weights or a bfp8 KV cache): every stage's PCC and the agreement on decisive positions within
``QUANT_BOUNDS`` of the coarsest format stored (docs/check.md: the figures they come from, and
what a wrong shard, a dropped collective or a swapped gather gives).

Mixture-of-experts families (``Family.hf_router``) also record every token's expert choice on
both sides. In bf16 a router near-tie can pick another expert on either side (transformers' own
bf16 does so against its fp32), and another expert is another function, so a step whose token
flipped can fall below the bound without a bug. The bf16 rule there: flips are rare (at most
``MAX_FLIP_SHARE`` of the choices), every stage below the bound follows a flip in the same step
at that layer or before it, and the prefill stays >= ``PCC_MIN_PREFILL_FLIPPED`` regardless. A
position whose token took other experts is not decisive.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .errors import InvalidInput

PCC_MIN_BF16 = 0.99
#: fp32 compute on bf16 storage: the same weights on both sides, so every layer agrees to float
#: rounding (measured > 0.99999 for every family); a wrong shard that keeps the greedy tokens
#: still falls far below this
PCC_MIN_FP32 = 0.9999
#: block-float packages (weights or KV cache): every layer's PCC against the bf16 reference and the
#: teacher-forced greedy-token agreement (docs/check.md has the figures these were chosen from)
#: (MoE: a layer below the PCC bound passes where a routing flip explains it, as in bf16, and at
#: most ``flips`` of the expert choices may differ)
#: (the head's logits compound every layer's error: a bfp4 DeepSeek's fell to 0.848 at a step
#: whose last layer kept 0.85, with no routing flip)
QUANT_BOUNDS = {"bfp8": {"layer_pcc": 0.99, "head_pcc": 0.99, "top1": 0.9, "flips": 0.1},
                "bfp4": {"layer_pcc": 0.85, "head_pcc": 0.8, "top1": 0.9, "flips": 0.35}}
MAX_FLIP_SHARE = 0.1
#: a reference top-1/top-2 logit margin within this many typical logit errors is a near-tie the
#: package's numerics can flip (module docstring)
MARGIN_SIGMAS = 5.0
#: the reference runs the prompt in calls of this many tokens (attention scores: heads x this x
#: context), and each decode step as a call of its own
REFERENCE_CHUNK = 128
#: prompt positions whose next-token predictions are compared, at most (evenly spaced, the first
#: and last included; every decode step is compared too): the logits of a position are a
#: vocabulary of floats per side (128,256 x 4 B for Llama 3), so comparing every position of a
#: 5,000-token prompt held ~5 GB; the stages' PCCs still cover every position
MAX_PROMPT_POSITIONS = 256
PCC_MIN_PREFILL_FLIPPED = 0.95
#: the stage depth the PCC bounds above were set at (docs/check.md's figures: models of 2-4
#: decoder layers). Each stage adds its own rounding error, independent of the others', so the
#: error of a stage's output grows in quadrature with depth and 1 - PCC (about half the squared
#: relative error) linearly: beyond this depth the allowed 1 - PCC of stage ``d`` (layer index + 1;
#: the head: layers + 1) is the bound's times ``d / CALIBRATED_DEPTH``, while what any one stage
#: adds to its predecessor's 1 - PCC stays within the bound itself (so a bad layer at depth 30 is
#: named as strictly as one at depth 1). Measured, Llama-3.1-8B-shaped, bfp8, random weights: 1 -
#: PCC grows by ~0.00045 per layer, 0.0144 at layer 32 (docs/benchmarks.md).
CALIBRATED_DEPTH = 4


def pcc(a, b) -> float:
    import torch

    a, b = a.double().flatten(), b.double().flatten()
    a, b = a - a.mean(), b - b.mean()
    den = (a.norm() * b.norm()).item()
    if den == 0:
        return 1.0 if torch.equal(a, b) else 0.0
    return float((a @ b).item() / den)


@dataclass
class LayerStat:
    step: str  # "prefill", "decode N" or "image"
    layer: int  # decoder layer; the head's is the number of decoder layers (it runs after them)
    max_abs: float
    pcc: float
    stage: str = "layer"  # "layer", "head" (final norm + LM head: the logits) or "image"

    @property
    def name(self) -> str:
        return f"layer {self.layer}" if self.stage == "layer" else self.stage


@dataclass
class CheckReport:
    bundle: str
    mesh: str
    dtype: str
    prompt_len: int
    steps: int
    #: the next-token prediction (argmax) of each side at every compared position: every prompt
    #: position, then each decode step's (the last prompt position's is the first step's)
    ref_tokens: list[int]
    emu_tokens: list[int]
    layers: list[LayerStat] = field(default_factory=list)
    shapes_run: list = field(default_factory=list)
    #: MoE only: {"moe_layers", "choices", "flipped", "flips": [(step label, layer)],
    #: "flipped_positions": [positions whose token took other experts in some layer]}
    routing: dict | None = None
    #: the package's storage: {"weights": {dtype: tensors}, "kv_cache": dtype}
    storage: dict = field(default_factory=lambda: {"weights": {"bf16": 1}, "kv_cache": "bf16"})
    kv_blocks: int = 0  # KV cache blocks the check allocated
    logits_pcc: list = field(default_factory=list)  # per step: next-token logits vs the reference
    continuation: list = field(default_factory=list)  # the tokens fed as decode steps (teacher forcing)
    #: per compared position: the reference's top-1 minus top-2 logit
    margins: list = field(default_factory=list)
    #: the typical logit error: median over positions of the std over the vocabulary of
    #: (emulated - reference) logits
    logit_error: float = 0.0
    #: the sequence position of each compared index (:func:`compared_prompt_positions`, then
    #: every decode step); empty: every position, in order
    positions: list = field(default_factory=list)

    @property
    def quantized(self) -> str | None:
        """The coarsest block-float format the package stores (weights or KV), else None."""
        fmts = set(self.storage["weights"]) | {self.storage["kv_cache"]}
        return "bfp4" if "bfp4" in fmts else "bfp8" if "bfp8" in fmts else None

    @property
    def margin_bound(self) -> float:
        """A top-1/top-2 margin the package's numerics can move: ``MARGIN_SIGMAS`` times the
        typical logit error (module docstring)."""
        return MARGIN_SIGMAS * self.logit_error

    def position(self, p: int) -> int:
        """The sequence position of compared index ``p``."""
        return self.positions[p] if self.positions else p

    def step_of(self, p: int) -> str:
        """The step label of compared index ``p``."""
        position = self.position(p)
        return "prefill" if position < self.prompt_len else f"decode {position - self.prompt_len + 1}"

    @property
    def decisive(self) -> list[int]:
        """The compared positions whose reference margin exceeds :attr:`margin_bound` (MoE: and
        whose token took the same experts on both sides in every layer)."""
        flipped = set(self.routing["flipped_positions"]) if self.routing else set()
        tau = self.margin_bound
        return [p for p, m in enumerate(self.margins) if m > tau and self.position(p) not in flipped]

    @property
    def top1_agreement(self) -> float:
        """Teacher-forced: the share of :attr:`decisive` positions whose next-token prediction
        equals the reference's (1.0 when none is decisive)."""
        d = self.decisive
        return sum(self.ref_tokens[p] == self.emu_tokens[p] for p in d) / len(d) if d else 1.0

    @property
    def bounds(self) -> dict:
        """The pass bounds that apply (module docstring)."""
        if self.quantized:
            return dict(QUANT_BOUNDS[self.quantized])
        if self.dtype == "bf16":
            return {"layer_pcc": PCC_MIN_BF16}
        return {"tokens": "identical where decisive", "layer_pcc": PCC_MIN_FP32}

    def _explained(self, s: LayerStat) -> bool:
        """A stage below the bound that a routing flip accounts for (module docstring)."""
        if not self.routing:
            return False
        flips = {tuple(f) for f in self.routing["flips"]}
        if not any((s.step, li) in flips for li in self.routing["moe_layers"] if li <= s.layer):
            return False
        return s.step != "prefill" or s.pcc >= PCC_MIN_PREFILL_FLIPPED

    @property
    def flips_ok(self) -> bool:
        r = self.routing
        share = QUANT_BOUNDS[self.quantized]["flips"] if self.quantized else MAX_FLIP_SHARE
        return not r or r["flipped"] <= share * r["choices"]

    @property
    def tokens_agree(self) -> bool:
        """Every decisive position's prediction is the reference's (a near-tie may differ)."""
        return all(self.ref_tokens[p] == self.emu_tokens[p] for p in self.decisive)

    @property
    def first_token_divergence(self) -> int | None:
        """The first compared position whose predictions differ (near-ties included)."""
        for i, (a, b) in enumerate(zip(self.ref_tokens, self.emu_tokens)):
            if a != b:
                return i
        return None

    def base_bound(self, s: LayerStat) -> float:
        """The calibrated PCC bound of stage ``s`` (the head's own where the format gives one)."""
        b = self.bounds
        return b.get("head_pcc", b["layer_pcc"]) if s.stage == "head" else b["layer_pcc"]

    def bound(self, s: LayerStat) -> float:
        """The PCC bound of stage ``s`` at its depth (:data:`CALIBRATED_DEPTH`)."""
        depth = 1 if s.stage == "image" else s.layer + 1
        return 1.0 - (1.0 - self.base_bound(s)) * max(1.0, depth / CALIBRATED_DEPTH)

    def added(self, s: LayerStat) -> float:
        """What stage ``s`` adds to 1 - PCC over the stage before it in the same step (the
        first stage: its whole 1 - PCC)."""
        if s.stage == "image" or s.layer == 0:
            return 1.0 - s.pcc
        prev = [t for t in self.layers if t.step == s.step and t.stage != "image" and t.layer < s.layer]
        return (1.0 - s.pcc) - (1.0 - max(prev, key=lambda t: t.layer).pcc) if prev else 1.0 - s.pcc

    def stage_failure(self, s: LayerStat) -> str:
        """Why stage ``s`` fails its bound, in words."""
        if s.pcc < self.bound(s):
            return f"PCC below {self.bound(s):.4g}"
        return (f"{s.name} adds {self.added(s):.3g} to 1 - PCC over the stage before it "
                f"(at most {1.0 - self.base_bound(s):.3g})")

    def _stage_ok(self, s: LayerStat) -> bool:
        explain = self.quantized or self.dtype == "bf16"
        within = s.pcc >= self.bound(s) and self.added(s) <= 1.0 - self.base_bound(s)
        return within or bool(explain and self._explained(s))

    @property
    def passed(self) -> bool:
        stages = all(self._stage_ok(s) for s in self.layers)
        if self.quantized:
            return stages and self.flips_ok and self.top1_agreement >= self.bounds["top1"]
        if self.dtype == "fp32":
            return stages and self.tokens_agree
        return stages and self.flips_ok

    def diverging(self) -> LayerStat | None:
        """The first (step, stage) that explains a failure: the first stage below its bound (in
        execution order: the image, each step's layers, then its head), else, where the
        predictions fail, the head at the first decisive position that differs."""
        if self.passed or not self.layers:
            return None
        bad = next((s for s in self.layers if not self._stage_ok(s)), None)
        if bad is not None:
            return bad
        wrong = next((p for p in self.decisive if self.ref_tokens[p] != self.emu_tokens[p]), None)
        if wrong is not None:
            step = self.step_of(wrong)
            return next(s for s in self.layers if s.stage == "head" and s.step == step)
        return min(self.layers, key=lambda s: s.pcc)

    def to_json(self) -> dict:
        d = self.diverging()
        return {
            "bundle": self.bundle, "mesh": self.mesh, "dtype": self.dtype, "passed": self.passed,
            "prompt_len": self.prompt_len, "steps": self.steps, "tokens_agree": self.tokens_agree,
            "first_token_divergence": self.first_token_divergence,
            "ref_tokens": self.ref_tokens, "emulated_tokens": self.emu_tokens,
            "continuation": self.continuation, "compared_positions": len(self.ref_tokens),
            "positions": [self.position(p) for p in range(len(self.ref_tokens))],
            "decisive_positions": len(self.decisive), "margin_bound": self.margin_bound,
            "logit_error": self.logit_error, "margins": self.margins,
            "first_diverging": None if d is None else {"step": d.step, "layer": d.layer, "stage": d.stage,
                                                       "pcc": d.pcc, "max_abs": d.max_abs},
            "layers": [dict(s.__dict__, bound=self.bound(s), added=self.added(s)) for s in self.layers],
            "shapes_run": [list(s) for s in sorted(self.shapes_run)],
            "storage": self.storage, "quantized": self.quantized, "bounds": self.bounds,
            "top1_agreement": self.top1_agreement, "kv_blocks": self.kv_blocks,
            "logits_pcc": self.logits_pcc,
            "routing": None if self.routing is None else {**self.routing,
                                                          "flips": [list(f) for f in self.routing["flips"]]},
        }


def run_check(bundle, mesh: str, steps: int = 32, dtype: str = "fp32", random_weights: bool = False,
              seed: int = 0, prompt_len: int | None = None, device: str = "cpu",
              package_hook=None, images: list | None = None) -> CheckReport:
    """``ttbundle check SPEC --mesh M``: build the package into a temporary directory, then
    check that package (:func:`check_package`). With ``random_weights`` the checkpoint is a
    random instance of the architecture, saved (bf16) beside it. ``package_hook(pkg_dir)`` runs
    between the build and the check (tests mutate the package there)."""
    import dataclasses
    import tempfile

    from . import reference
    from .build import build

    if dtype not in ("fp32", "bf16"):
        raise InvalidInput(f"--dtype {dtype!r}: use fp32 or bf16")
    with tempfile.TemporaryDirectory(prefix="ttbundle-check-") as tmp:
        tmp = Path(tmp)
        if random_weights:
            src = tmp / "checkpoint"
            reference.save_random(bundle, src, seed)
        else:
            if bundle.spec.weights.source is None:
                raise InvalidInput(f"{bundle.file}: weights.source is not set; give it or use --random-weights")
            src = bundle.resolve_path(bundle.spec.weights.source)
        w = bundle.spec.weights.model_copy(update={"source": str(src.absolute())})
        # random weights come without a tokenizer: the temporary package is token ids only
        b = dataclasses.replace(bundle, spec=bundle.spec.model_copy(
            update={"weights": w, **({"tokenizer": False} if random_weights else {})}))
        res = build(b, mesh, tmp / "out", warmup=False)
        if package_hook is not None:
            package_hook(Path(res.package))
        return check_package(res.package, src, steps=steps, dtype=dtype, seed=seed, prompt_len=prompt_len,
                             device=device, images=images)


def check_package(pkg_dir, reference_dir, steps: int = 32, dtype: str = "fp32", seed: int = 0,
                  prompt_len: int | None = None, device: str = "cpu", images: list | None = None) -> CheckReport:
    """``ttbundle check PACKAGE_DIR``: the package's own programs on its own weight bytes (bf16
    values, bfp8/bfp4 tiles decoded as ttnn decodes them), its KV cache in its declared dtype,
    against transformers in float32 on the checkpoint in ``reference_dir`` (rounded to bf16, the
    package's finest storage), its KV cache stored like the package's when that is bf16. Both
    sides hold one decoder layer at a time (module docstring)."""
    import torch

    from . import reference
    from .backends.emulated import EmulatedModel, Runner
    from .package.load import load_package
    from .package.shards import trim_heap

    if dtype not in ("fp32", "bf16"):
        raise InvalidInput(f"--dtype {dtype!r}: use fp32 or bf16")
    tdtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    pkg = load_package(pkg_dir, verify=True)
    bundle = pkg.bundle
    rt = bundle.spec.runtime
    kv_dtype = rt.kv_cache_dtype

    b = bundle.buckets
    chunk = b.prefill_chunk or max(b.prefill)
    if prompt_len is None:
        prompt_len = min(chunk + chunk // 3 + 1, rt.max_model_len - steps - 1)
    if prompt_len < 1 or prompt_len + steps > rt.max_model_len:
        raise InvalidInput(f"prompt of {prompt_len} + {steps} steps must fit max_model_len={rt.max_model_len}")
    g = torch.Generator().manual_seed(seed + 1)
    prompt = torch.randint(0, bundle.arch.vocab_size, (prompt_len,), generator=g).tolist()
    mm, inputs, rope, delta = None, None, None, 0
    part = bundle.family.vision_part(bundle.arch)  # the family's vision part owns what differs
    if images:
        from . import vision
        inputs = {k: x.to(tdtype) if x.is_floating_point() else x
                  for k, x in vision.image_inputs(bundle, images).items()}
        prompt, mm = vision.prompt_with_images(bundle, prompt, len(images), chunk, inputs)
        if len(prompt) + steps > rt.max_model_len:
            raise InvalidInput(f"a prompt of {len(prompt)} tokens with its images + {steps} steps must fit "
                               f"max_model_len={rt.max_model_len}; give fewer --steps or images")
        prompt_len = len(prompt)
    if part is not None:  # the prompt's positions (M-RoPE: its 3-row positions; None: plain)
        pos = part.positions(prompt, inputs)
        rope, delta = pos.rope, pos.delta
    cont = continuation(prompt, steps - 1, () if part is None else set(part.special_tokens()) | {part.placeholder()})
    seq = prompt + cont
    labels = ["prefill"] * prompt_len + [f"decode {i}" for i in range(1, steps)]

    # the reference: transformers' skeleton; one layer materialized at a time
    ref = reference.LayerwiseModel(reference_dir, tdtype, device, kv_dtype if kv_dtype == "bf16" else None)
    n_layers = len(ref.layers)
    router = bundle.family.hf_router
    routes: dict = {"hf": {}, "emu": {}}  # layer -> [set of experts per token] in sequence order
    hooks = []
    if router:
        for li, layer in enumerate(ref.layers):
            for m in layer.modules():
                if type(m).__name__ == router[0]:
                    hooks.append(m.register_forward_hook(
                        lambda m, i, o, li=li: routes["hf"].setdefault(li, []).extend(set(r) for r in o[2].tolist())))
    image_ref = []
    kw = {} if mm is None else part.reference_kwargs(seq, inputs, device)
    h_ref, layer_calls = ref.record(
        seq, reference_segments(prompt_len, len(seq), [] if mm is None else mm["positions"]), kw,
        images=mm is not None, on_vision=None if mm is None else
        lambda: image_ref.append(part.reference_features(ref.model, inputs, device).float().cpu()))

    kernels = None
    if router:
        from .backends.emulated.kernel_table import KERNELS
        base = KERNELS[router[1]]

        def route(ctx, layer, scores):  # device 0's routing weights: nonzero = chosen
            r = base(ctx, layer, scores)
            routes["emu"].setdefault(layer, []).append([set(torch.nonzero(row).flatten().tolist()) for row in r[0]])
            return r
        kernels = {router[1]: route}
    model = EmulatedModel.from_package(pkg, dtype=tdtype, device=device, kernels=kernels, lazy=True)
    # only the KV blocks this prompt and these steps need (block 0 stays unused, as vLLM's null block)
    need = -(-(prompt_len + steps) // rt.kv_block_size)
    runner = Runner(model, num_blocks=need + 1)
    blocks = list(range(1, need + 1))
    stats: list = []
    image_stat = None

    def free():
        model.release()  # closes the package's files too: what was read does not stay resident
        trim_heap()

    with torch.no_grad():
        if mm is not None:  # the package's vision program against transformers' image features
            mm["embeds"] = model.encode_images(inputs["pixel_values"].to(device), inputs.get("image_grid_thw"))
            free()
            from .vision import vision_bucket
            vb, _ = vision_bucket(part, sorted(b for ph, b in model.programs if ph == "vision"),
                                  inputs["pixel_values"], inputs.get("image_grid_thw"))
            runner.shapes_run.add(("vision", vb))
            e = mm["embeds"].float().cpu()
            image_stat = LayerStat("image", 0, float((image_ref[0] - e).abs().max()), pcc(image_ref[0], e), "image")
        sel = compared_prompt_positions(prompt_len)
        idx = sel + list(range(prompt_len, len(seq)))
        calls = runner.prefill_calls(prompt, blocks, capture=True, mm=mm, rope_positions=rope, head_rows=sel)
        n_pre = len(calls)
        calls += [runner.decode_call([t], [prompt_len + i], [blocks], capture=True,
                                     rope_deltas=None if rope is None else [delta]) for i, t in enumerate(cont)]

        def after(stage):
            nonlocal h_ref
            _, li = stage
            free()
            if li is None:
                return
            emu = torch.cat([c.capture.pop()[0, :c.rows] if k < n_pre else c.capture.pop()[:c.rows, 0]
                             for k, c in enumerate(calls)]).float().cpu()
            h_ref = ref.run_layer(li, h_ref, layer_calls[li])
            trim_heap()
            stats.extend(_stats(h_ref[0].float().cpu(), emu, labels, li, "layer"))
            if router and li in routes["hf"]:
                rows = routes["emu"].pop(li, [])
                routes["emu"][li] = sum((r[:c.rows] for r, c in zip(rows, calls)), [])

        out = model.run_layer_major(calls, after_stage=after)
        wanted = set(sel)
        emu_logits = torch.cat([lg[0, [r for r, j in enumerate(c.head_rows) if j in wanted]] if k < n_pre
                                else lg[:c.rows, 0] for k, (lg, c) in enumerate(zip(out, calls))]).float().cpu()
        del out
        ref_logits = ref.head(h_ref[:, idx])[0].float().cpu()
    for h in hooks:
        h.remove()
    head_labels = [labels[j] for j in idx]
    stats.extend(_stats(ref_logits, emu_logits, head_labels, n_layers, "head"))
    order = {lab: i for i, lab in enumerate(dict.fromkeys(labels))}
    stats.sort(key=lambda s: (order[s.step], s.layer))
    top2 = ref_logits.topk(2, dim=-1).values
    err = (emu_logits.double() - ref_logits.double()).std(dim=-1, unbiased=False)
    report = CheckReport(bundle.spec.name, pkg.mesh.name, dtype, prompt_len, steps,
                         ref_logits.argmax(-1).tolist(), emu_logits.argmax(-1).tolist(), layers=stats,
                         shapes_run=sorted(runner.shapes_run), storage=storage_of(pkg),
                         kv_blocks=runner.kv.num_blocks, continuation=cont,
                         margins=(top2[:, 0] - top2[:, 1]).tolist(), logit_error=float(err.median()),
                         positions=idx)
    if image_stat is not None:
        report.layers.insert(0, image_stat)
    last = idx.index(prompt_len - 1)  # the next-token logits of the prompt, then of each step
    report.logits_pcc = [pcc(ref_logits[p], emu_logits[p]) for p in range(last, len(idx))]
    if router:
        report.routing = _routing(routes, labels)
    return report


def compared_prompt_positions(prompt_len: int) -> list[int]:
    """The prompt positions whose next-token predictions are compared: every one up to
    :data:`MAX_PROMPT_POSITIONS`, else that many evenly spaced, the first and last included."""
    n = min(prompt_len, MAX_PROMPT_POSITIONS)
    if n == prompt_len:
        return list(range(prompt_len))
    return sorted({round(k * (prompt_len - 1) / (n - 1)) for k in range(n)})


def reference_segments(prompt_len: int, total: int, image_positions=()) -> list:
    """The reference's calls: the prompt in chunks of ``REFERENCE_CHUNK`` tokens (the first one
    long enough to hold every image), then one call per decode step, so its attention holds
    ``REFERENCE_CHUNK`` rows of scores at a time whatever the package's prefill chunk."""
    first = min(prompt_len, max(REFERENCE_CHUNK, max(image_positions, default=-1) + 2))
    cuts = [0] + list(range(first, prompt_len, REFERENCE_CHUNK)) + list(range(prompt_len, total + 1))
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


def continuation(prompt: list[int], n: int, special=()) -> list[int]:
    """The ``n`` tokens fed as decode steps: the prompt's own (text) tokens again, from its start.
    Fixed before anything runs, so every layer can run over every step in turn (the greedy
    token of a step is known only after the last layer); a repeated text is what a trained model
    predicts with confidence (decisive margins), where a random one gives near-ties."""
    text = [t for t in prompt if t not in special] or [0]
    return [text[i % len(text)] for i in range(n)]


def _stats(ref, emu, labels: list, layer: int, stage: str) -> list:
    """Per step: the prompt's positions together, each decode step's alone."""
    out = []
    for lab in dict.fromkeys(labels):
        idx = [i for i, x in enumerate(labels) if x == lab]
        r, e = ref[idx[0]:idx[-1] + 1], emu[idx[0]:idx[-1] + 1].reshape(len(idx), -1)
        out.append(LayerStat(lab, layer, float((r - e).abs().max()), pcc(r, e), stage))
    return out


def recorded_checkpoint(pkg_dir) -> Path:
    """The checkpoint a package was built from, as its manifest records it (``sources.weights``),
    if it is still there unchanged: the build's own test (``cache.source_records``: a digest is
    reused while size, mtime and inode match, else the file is hashed again with BLAKE3)."""
    from . import cache
    from .package.verify import read_manifest

    pkg_dir = Path(pkg_dir)
    recs = (read_manifest(pkg_dir).get("sources") or {}).get("weights") or []
    if not recs:
        raise InvalidInput(f"{pkg_dir}: manifest.json records no source checkpoint; give --reference DIR")
    d = Path(recs[0]["dir"])
    files = [d / r["name"] for r in recs]
    gone = next((p for p in files if not p.is_file()), None)
    if gone is not None:
        raise InvalidInput(f"{pkg_dir}: the checkpoint it was built from is gone ({gone}); give "
                           f"--reference DIR")
    now = cache.source_records(files, recs, d)
    cache.fill_digests(now)
    for r, was in zip(now, recs):
        if r["size"] != was["size"] or r["blake3"] != was.get("blake3"):
            raise InvalidInput(f"{pkg_dir}: {d / r['name']} changed since the package was built (its "
                               f"BLAKE3 digest differs from the manifest's); rebuild, or give --reference DIR")
    return d


def storage_of(pkg) -> dict:
    """The package's storage dtypes: weights (per dtype, how many tensors) and the KV cache."""
    counts: dict = {}
    for r in pkg.weights.refs.values():
        counts[r.dtype] = counts.get(r.dtype, 0) + 1
    return {"weights": counts, "kv_cache": pkg.bundle.spec.runtime.kv_cache_dtype}


def _routing(routes: dict, labels: list) -> dict:
    """Both sides' expert choices per (token, MoE layer) compared (the emulated calls' rows
    joined in sequence order, bucket padding dropped)."""
    hf, emu = routes["hf"], routes["emu"]
    moe = sorted(hf)
    if not moe:
        raise RuntimeError("no router calls recorded on the reference")
    flips, flipped, choices, positions = [], 0, 0, set()
    for li in moe:
        h, e = hf[li], emu.get(li, [])
        if len(h) != len(labels) or len(e) != len(labels):
            raise RuntimeError(f"layer {li}: {len(h)} reference tokens routed, {len(e)} emulated, "
                               f"{len(labels)} in the sequence")
        bad = [p for p, (a, b) in enumerate(zip(h, e)) if a != b]
        choices += len(h)
        flipped += len(bad)
        positions.update(bad)
        for lab in dict.fromkeys(labels[p] for p in bad):
            flips.append((lab, li))
    order = {lab: i for i, lab in enumerate(dict.fromkeys(labels))}
    flips.sort(key=lambda f: (order[f[0]], f[1]))
    return {"moe_layers": moe, "choices": choices, "flipped": flipped, "flips": flips,
            "flipped_positions": sorted(positions)}
