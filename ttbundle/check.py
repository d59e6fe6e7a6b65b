"""`ttbundle check`: a package's programs on the emulated mesh against Hugging Face transformers.

What is checked is what ships: the package's own programs (``programs/*.json``) executed on its
own weight bytes (bf16, or bfp8/bfp4 tiles decoded as ttnn decodes them), with its KV cache held
in its declared dtype. ``check SPEC`` builds the package into a temporary directory first. The
reference is transformers in float32 on the checkpoint the package was built from, its weights
rounded to bf16 (the package's finest storage) and, for a bf16 KV cache, its cache rounded to
bf16 on every write as the package's is. Both run a prompt (chunked by the bundle's prefill
chunk), then ``steps`` decode steps teacher-forced with the reference's greedy token. Per layer
and step: the residual stream (max-abs error, PCC); per step: the greedy token.

Pass, bf16 storage: fp32 compute -> every greedy token identical and every layer's PCC >=
``PCC_MIN_FP32``; bf16 compute -> every layer's PCC >= ``PCC_MIN_BF16``. Block floats (bfp8/bfp4
weights or a bfp8 KV cache): every layer's PCC and the teacher-forced token agreement within
``QUANT_BOUNDS`` of the coarsest format stored (docs/check.md: the figures they come from, and
what a wrong shard, a dropped collective or a swapped gather gives).

Mixture-of-experts families (``Family.hf_router``) also record every token's expert choice on
both sides. In bf16 a router near-tie can pick another expert on either side (transformers' own
bf16 does so against its fp32), and another expert is another function, so a step whose token
flipped can fall below the bound without a bug. The bf16 rule there: flips are rare (at most
``MAX_FLIP_SHARE`` of the choices), every layer below the bound follows a flip in the same step
at that layer or before it, and the prefill stays >= ``PCC_MIN_PREFILL_FLIPPED`` regardless.
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
QUANT_BOUNDS = {"bfp8": {"layer_pcc": 0.99, "top1": 0.9, "flips": 0.1},
                "bfp4": {"layer_pcc": 0.85, "top1": 0.35, "flips": 0.35}}
MAX_FLIP_SHARE = 0.1
PCC_MIN_PREFILL_FLIPPED = 0.95


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
    step: str  # "prefill" or "decode N"
    layer: int
    max_abs: float
    pcc: float


@dataclass
class CheckReport:
    bundle: str
    mesh: str
    dtype: str
    prompt_len: int
    steps: int
    ref_tokens: list[int]
    emu_tokens: list[int]
    layers: list[LayerStat] = field(default_factory=list)
    shapes_run: list = field(default_factory=list)
    #: MoE only: {"moe_layers", "choices", "flipped", "flips": [(step label, layer)]}
    routing: dict | None = None
    #: the package's storage: {"weights": {dtype: tensors}, "kv_cache": dtype}
    storage: dict = field(default_factory=lambda: {"weights": {"bf16": 1}, "kv_cache": "bf16"})
    kv_blocks: int = 0  # KV cache blocks the check allocated
    logits_pcc: list = field(default_factory=list)  # per step: next-token logits vs the reference

    @property
    def quantized(self) -> str | None:
        """The coarsest block-float format the package stores (weights or KV), else None."""
        fmts = set(self.storage["weights"]) | {self.storage["kv_cache"]}
        return "bfp4" if "bfp4" in fmts else "bfp8" if "bfp8" in fmts else None

    @property
    def top1_agreement(self) -> float:
        """Teacher-forced: the share of steps whose greedy token equals the reference's (MoE: of
        the steps where both sides chose the same experts in every layer; another expert is
        another function)."""
        flipped = {f[0] for f in self.routing["flips"]} if self.routing else set()
        pairs = [(a, b) for i, (a, b) in enumerate(zip(self.ref_tokens, self.emu_tokens))
                 if ("prefill" if i == 0 else f"decode {i}") not in flipped]
        return sum(a == b for a, b in pairs) / len(pairs) if pairs else 0.0

    @property
    def bounds(self) -> dict:
        """The pass bounds that apply (module docstring)."""
        if self.quantized:
            return dict(QUANT_BOUNDS[self.quantized])
        if self.dtype == "bf16":
            return {"layer_pcc": PCC_MIN_BF16}
        return {"tokens": "identical", "layer_pcc": PCC_MIN_FP32}

    def _explained(self, s: LayerStat) -> bool:
        """A layer below the bf16 bound that a routing flip accounts for (module docstring)."""
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
        return self.ref_tokens == self.emu_tokens

    @property
    def first_token_divergence(self) -> int | None:
        for i, (a, b) in enumerate(zip(self.ref_tokens, self.emu_tokens)):
            if a != b:
                return i
        return None

    def worst(self, layer: int) -> LayerStat:
        return min((s for s in self.layers if s.layer == layer), key=lambda s: s.pcc)

    def first_bad_layer(self, threshold: float) -> LayerStat | None:
        for s in self.layers:  # in execution order: prefill layers, then each decode step
            if s.pcc < threshold:
                return s
        return None

    @property
    def passed(self) -> bool:
        if self.quantized:
            b = self.bounds
            return self.flips_ok and self.top1_agreement >= b["top1"] and \
                all(s.pcc >= b["layer_pcc"] or self._explained(s) for s in self.layers)
        if self.dtype == "fp32":
            return self.tokens_agree and all(s.pcc >= PCC_MIN_FP32 for s in self.layers)
        return self.flips_ok and all(s.pcc >= PCC_MIN_BF16 or self._explained(s) for s in self.layers)

    def diverging(self) -> LayerStat | None:
        """The first (step, layer) that explains a failure."""
        if self.quantized or self.dtype == "bf16":
            bound = self.bounds["layer_pcc"]
            return next((s for s in self.layers if s.pcc < bound and not self._explained(s)), None) \
                or (min(self.layers, key=lambda s: s.pcc) if self.layers and not self.passed else None)
        bad = self.first_bad_layer(PCC_MIN_FP32)
        return bad or (min(self.layers, key=lambda s: s.pcc) if self.layers else None)

    def to_json(self) -> dict:
        d = self.diverging() if not self.passed else None
        return {
            "bundle": self.bundle, "mesh": self.mesh, "dtype": self.dtype, "passed": self.passed,
            "prompt_len": self.prompt_len, "steps": self.steps, "tokens_agree": self.tokens_agree,
            "first_token_divergence": self.first_token_divergence,
            "ref_tokens": self.ref_tokens, "emulated_tokens": self.emu_tokens,
            "first_diverging": None if d is None else {"step": d.step, "layer": d.layer,
                                                       "pcc": d.pcc, "max_abs": d.max_abs},
            "layers": [s.__dict__ for s in self.layers],
            "shapes_run": [list(s) for s in sorted(self.shapes_run)],
            "storage": self.storage, "quantized": self.quantized, "bounds": self.bounds,
            "top1_agreement": self.top1_agreement, "kv_blocks": self.kv_blocks,
            "logits_pcc": self.logits_pcc,
            "routing": None if self.routing is None else {**self.routing,
                                                          "flips": [list(f) for f in self.routing["flips"]]},
        }


def _decoder_layers(model):
    for path in ("model.layers", "model.language_model.layers", "transformer.h"):
        obj = model
        try:
            for p in path.split("."):
                obj = getattr(obj, p)
            return list(obj)
        except AttributeError:
            continue
    raise RuntimeError(f"cannot find the decoder layers of {type(model).__name__}")


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
    package's finest storage), its KV cache stored like the package's when that is bf16."""
    import torch

    from . import reference
    from .backends.emulated import EmulatedModel, Runner
    from .package import load_package

    if dtype not in ("fp32", "bf16"):
        raise InvalidInput(f"--dtype {dtype!r}: use fp32 or bf16")
    tdtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    pkg = load_package(pkg_dir, verify=True)
    bundle = pkg.bundle
    rt = bundle.spec.runtime
    kv_dtype = rt.kv_cache_dtype
    hf = reference.load_model(reference_dir)
    reference.round_to_bf16(hf)
    hf = hf.to(tdtype).to(device)

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
    if part is not None and hasattr(part, "rope_positions"):  # M-RoPE: the prompt's 3-row positions
        rope, delta = part.rope_positions(bundle.arch.vision, prompt, inputs)

    # reference: per-layer outputs via forward hooks (independent of hidden_states conventions)
    cap: list = []
    decoder = _decoder_layers(hf)
    hooks = [layer.register_forward_hook(lambda m, i, o: cap.append((o[0] if isinstance(o, tuple) else o)))
             for layer in decoder]
    router = bundle.family.hf_router
    routes: dict = {"hf": [], "emu": []}  # (layer, [set of experts per token]) in call order
    if router:
        for li, layer in enumerate(decoder):
            for m in layer.modules():
                if type(m).__name__ == router[0]:
                    hooks.append(m.register_forward_hook(
                        lambda m, i, o, li=li: routes["hf"].append((li, [set(r) for r in o[2].tolist()]))))
    ref_layers, ref_tokens, ref_logits = [], [], []
    try:
        with torch.no_grad():
            past = reference.kv_cache(hf, kv_dtype if kv_dtype == "bf16" else None)
            kw = {} if mm is None else part.reference_kwargs(bundle.arch.vision, prompt, inputs, device)
            out = hf(torch.tensor([prompt], device=device), past_key_values=past, use_cache=True, **kw)
            ref_layers.append([c[0] for c in cap])
            cap.clear()
            past = out.past_key_values
            tok = int(out.logits[0, -1].argmax())
            ref_tokens.append(tok)
            ref_logits.append(out.logits[0, -1].float().cpu())
            for _ in range(steps - 1):
                out = hf(torch.tensor([[tok]], device=device), past_key_values=past, use_cache=True)
                ref_layers.append([c[0, 0] for c in cap])
                cap.clear()
                past = out.past_key_values
                tok = int(out.logits[0, -1].argmax())
                ref_tokens.append(tok)
                ref_logits.append(out.logits[0, -1].float().cpu())
    finally:
        for h in hooks:
            h.remove()

    kernels = None
    if router:
        from .backends.emulated.kernels import KERNELS
        base = KERNELS[router[1]]

        def route(ctx, layer, scores):  # device 0's routing weights: nonzero = chosen
            r = base(ctx, layer, scores)
            routes["emu"].append((layer, [set(torch.nonzero(row).flatten().tolist()) for row in r[0]]))
            return r
        kernels = {router[1]: route}
    model = EmulatedModel.from_package(pkg, dtype=tdtype, device=device, kernels=kernels)
    # only the KV blocks this prompt and these steps need (block 0 stays unused, as vLLM's null block)
    need = -(-(prompt_len + steps) // rt.kv_block_size)
    runner = Runner(model, num_blocks=need + 1)
    blocks = list(range(1, need + 1))
    emu_layers: list = []
    emu_logits = []
    image_stat = None
    with torch.no_grad():
        if mm is not None:  # the package's vision program against transformers' image features
            mm["embeds"] = model.encode_images(inputs["pixel_values"].to(device), inputs.get("image_grid_thw"))
            need = part.bucket_need(bundle.arch.vision, inputs)
            runner.shapes_run.add(("vision", min(b for ph, b in model.programs if ph == "vision" and b >= need)))
            ref_img = part.reference_features(hf, inputs, device).float().cpu()
            e = mm["embeds"].float().cpu()
            image_stat = LayerStat("image", 0, float((ref_img - e).abs().max()), pcc(ref_img, e))
        logits = runner.prefill(prompt, blocks, capture=emu_layers, mm=mm, rope_positions=rope)
        emu_tokens = [int(logits.argmax())]
        emu_logits.append(logits.float().cpu())
        prefill_caps = [torch.cat([c[i] for c in emu_layers], dim=0) for i in range(len(emu_layers[0]))]
        per_step = [prefill_caps]
        pos = prompt_len
        for i in range(steps - 1):
            c: list = []
            lg = runner.decode([ref_tokens[i]], [pos], [blocks], capture=c,
                               rope_deltas=None if rope is None else [delta])
            pos += 1
            emu_tokens.append(int(lg[0].argmax()))
            emu_logits.append(lg[0].float().cpu())
            per_step.append([x[0] for x in c[0]])

    report = CheckReport(bundle.spec.name, pkg.mesh.name, dtype, prompt_len, steps, ref_tokens, emu_tokens,
                         shapes_run=sorted(runner.shapes_run), storage=storage_of(pkg),
                         kv_blocks=runner.kv.num_blocks)
    for si, (r_layers, e_layers) in enumerate(zip(ref_layers, per_step)):
        label = "prefill" if si == 0 else f"decode {si}"
        for li, (r, e) in enumerate(zip(r_layers, e_layers)):
            r, e = r.float().cpu(), e.float().cpu().reshape(r.shape)
            report.layers.append(LayerStat(label, li, float((r - e).abs().max()), pcc(r, e)))
    if image_stat is not None:
        report.layers.insert(0, image_stat)
    report.logits_pcc = [pcc(r, e) for r, e in zip(ref_logits, emu_logits)]
    if router:
        report.routing = _routing(routes, prompt_len, chunk, steps)
    return report


def recorded_checkpoint(pkg_dir) -> Path:
    """The checkpoint a package was built from, as its manifest records it (``sources.weights``),
    if it is still there unchanged: the build's own test (``cache.source_records``: a digest is
    reused while size, mtime and inode match, else the file is hashed again with BLAKE3)."""
    from . import cache
    from .package import read_manifest

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


def _routing(routes: dict, prompt_len: int, chunk: int, steps: int) -> dict:
    """Both sides' expert choices per (step, MoE layer, token) compared: the prefill's chunks
    joined and bucket padding dropped on the emulated side."""
    hf, emu = routes["hf"], routes["emu"]
    moe = sorted({li for li, _ in hf})
    n = len(moe)
    if not n or len(hf) != n * steps:
        raise RuntimeError(f"router calls: {len(hf)} for {n} MoE layers x {steps} steps")
    n_chunks = -(-prompt_len // chunk)
    lens = [min(chunk, prompt_len - c * chunk) for c in range(n_chunks)]
    if len(emu) != n * (n_chunks + steps - 1):
        raise RuntimeError(f"emulated router calls: {len(emu)}, expected {n * (n_chunks + steps - 1)}")
    emu_steps = [{li: sum((emu[c * n + k][1][:lens[c]] for c in range(n_chunks)), [])
                  for k, li in enumerate(moe)}]
    for st in range(steps - 1):
        base = (n_chunks + st) * n
        emu_steps.append({li: emu[base + k][1][:1] for k, li in enumerate(moe)})
    flips, flipped, choices = [], 0, 0
    for si in range(steps):
        label = "prefill" if si == 0 else f"decode {si}"
        for k, li in enumerate(moe):
            h, e = hf[si * n + k][1], emu_steps[si][li]
            if len(h) != len(e):
                raise RuntimeError(f"{label} layer {li}: {len(h)} reference tokens, {len(e)} emulated")
            bad = sum(a != b for a, b in zip(h, e))
            choices += len(h)
            flipped += bad
            if bad:
                flips.append((label, li))
    return {"moe_layers": moe, "choices": choices, "flipped": flipped, "flips": flips}
