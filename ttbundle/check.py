"""`ttbundle check`: the emulated mesh against Hugging Face transformers, layer by layer.

Both run the same weights on the same tokens: a prompt (chunked by the bundle's prefill chunk),
then ``steps`` greedy decode steps in which both are fed the reference's token. Per layer and
step we compare the residual stream (max-abs error, PCC) and the greedy token. Pass: fp32 -> every
greedy token identical; bf16 -> every layer's PCC >= 0.99 (and tokens are reported).

Mixture-of-experts families (``Family.hf_router``) also record every token's expert choice on
both sides. In bf16 a router near-tie can pick another expert on either side (transformers' own
bf16 does so against its fp32), and another expert is another function, so a step whose token
flipped can fall below the bound without a bug. The bf16 rule there: flips are rare (at most
``MAX_FLIP_SHARE`` of the choices), every layer below the bound follows a flip in the same step
at that layer or before it, and the prefill stays >= ``PCC_MIN_PREFILL_FLIPPED`` regardless.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import InvalidInput
from .plan import make_plan

PCC_MIN_BF16 = 0.99
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
        return not r or r["flipped"] <= MAX_FLIP_SHARE * r["choices"]

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
        if self.dtype == "fp32":
            return self.tokens_agree
        return self.flips_ok and all(s.pcc >= PCC_MIN_BF16 or self._explained(s) for s in self.layers)

    def diverging(self) -> LayerStat | None:
        """The first (step, layer) that explains a failure."""
        if self.dtype == "bf16":
            return next((s for s in self.layers if s.pcc < PCC_MIN_BF16 and not self._explained(s)), None)
        bad = self.first_bad_layer(0.9999)
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
              seed: int = 0, prompt_len: int | None = None, device: str = "cpu", plan=None) -> CheckReport:
    import torch

    from . import reference, weights
    from .backends.emulated import EmulatedModel, Runner

    if dtype not in ("fp32", "bf16"):
        raise InvalidInput(f"--dtype {dtype!r}: use fp32 or bf16")
    tdtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    plan = plan or make_plan(bundle, mesh)
    rt = bundle.spec.runtime
    if random_weights:
        hf = reference.random_model(bundle, seed)
        canon = weights.from_state_dict(bundle.family, bundle.arch, reference.checkpoint_state_dict(hf))
    else:
        src = bundle.spec.weights.source
        if src is None:
            raise InvalidInput(f"{bundle.file}: weights.source is not set; give it or use --random-weights")
        d = bundle.resolve_path(src)
        canon = weights.load_canonical(bundle.family, bundle.arch, d)
        hf = reference.load_model(d)
    hf = hf.to(tdtype).to(device)

    b = bundle.buckets
    chunk = b.prefill_chunk or max(b.prefill)
    if prompt_len is None:
        prompt_len = min(chunk + chunk // 3 + 1, rt.max_model_len - steps - 1)
    if prompt_len < 1 or prompt_len + steps > rt.max_model_len:
        raise InvalidInput(f"prompt of {prompt_len} + {steps} steps must fit max_model_len={rt.max_model_len}")
    g = torch.Generator().manual_seed(seed + 1)
    prompt = torch.randint(0, bundle.arch.vocab_size, (prompt_len,), generator=g).tolist()

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
    ref_layers, ref_tokens = [], []
    try:
        with torch.no_grad():
            out = hf(torch.tensor([prompt], device=device), use_cache=True)
            ref_layers.append([c[0] for c in cap])
            cap.clear()
            past = out.past_key_values
            tok = int(out.logits[0, -1].argmax())
            ref_tokens.append(tok)
            for _ in range(steps - 1):
                out = hf(torch.tensor([[tok]], device=device), past_key_values=past, use_cache=True)
                ref_layers.append([c[0, 0] for c in cap])
                cap.clear()
                past = out.past_key_values
                tok = int(out.logits[0, -1].argmax())
                ref_tokens.append(tok)
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
    model = EmulatedModel(bundle, plan, canon, dtype=tdtype, device=device, kernels=kernels)
    runner = Runner(model)
    blocks = list(range(runner.max_blocks))
    emu_layers: list = []
    with torch.no_grad():
        logits = runner.prefill(prompt, blocks, capture=emu_layers)
        emu_tokens = [int(logits.argmax())]
        prefill_caps = [torch.cat([c[i] for c in emu_layers], dim=0) for i in range(len(emu_layers[0]))]
        per_step = [prefill_caps]
        pos = prompt_len
        for i in range(steps - 1):
            c: list = []
            lg = runner.decode([ref_tokens[i]], [pos], [blocks], capture=c)
            pos += 1
            emu_tokens.append(int(lg[0].argmax()))
            per_step.append([x[0] for x in c[0]])

    report = CheckReport(bundle.spec.name, plan.mesh.name, dtype, prompt_len, steps, ref_tokens, emu_tokens,
                         shapes_run=sorted(runner.shapes_run))
    for si, (r_layers, e_layers) in enumerate(zip(ref_layers, per_step)):
        label = "prefill" if si == 0 else f"decode {si}"
        for li, (r, e) in enumerate(zip(r_layers, e_layers)):
            r, e = r.float().cpu(), e.float().cpu().reshape(r.shape)
            report.layers.append(LayerStat(label, li, float((r - e).abs().max()), pcc(r, e)))
    if router:
        report.routing = _routing(routes, prompt_len, chunk, steps)
    return report


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
