"""`ttbundle check`: two verdicts a package ships on (docs/check.md).

**Executor** (``check.verdict``): the package's own programs (``programs/*.json``) on its own
weight bytes (bf16, or bfp8/bfp4 tiles decoded as ttnn decodes them), its KV cache in its
declared dtype, on the emulated mesh, against an *expected run*: transformers (float32) on the
checkpoint stored as the package declares it (``check.expected``), its KV cache stored as the
package's. Each stage (image, embedding, decoder layers, head) is judged locally: the expected
side runs it on the emulated side's input to it, so the two differ by that stage's arithmetic
alone, at any depth; the metric is the normalised error (per channel, against the stage's own
update), the bounds the compute dtype's. A bug fails at any storage and depth, named by stage
and step.

**Quality** (``check.quality``): the package's next-token distributions against the original
checkpoint's (transformers, float32, the checkpoint rounded to bf16), teacher-forced on natural
text (the package's tokenizer; ``ttbundle/data/quality.txt`` by default): top-1, top-5, KL
divergence, perplexity ratio, against the spec's targets per storage.

Layer by layer, in bounded memory. No side ever holds the model: the emulated mesh reads one
layer's shards at a time from the package (``EmulatedModel.run_layer_major`` on a lazy model);
transformers is a skeleton on the ``meta`` device (``reference.LayerwiseModel``) whose recording
forward gives each decoder layer's arguments per call (masks, position embeddings), after which
each layer is read (from the checkpoint, or as stored), run over every call with its own cache,
compared and freed; then the final norm and LM head (the "head" stage). Peak memory is a fixed
amount plus one layer per side (and the largest tensor), whatever the depth
(``tests/test_check_memory.py``). ``check SPEC`` builds the package into a temporary directory
first; ``check PACKAGE`` keeps a record in it (``check.record``).
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InvalidInput

from .quality import Quality, default_text, measure, targets_for
from .verdict import (EXEC_BOUNDS, HEAD_BOUNDS, MARGIN_SIGMAS, MIN_DECISIVE, STAGE_ORDER, Executor, Stage,
                      normalised_error, pcc, router_tie)
from .. import cache, reference, vision
from ..build import build
from ..package.names import has_tokenizer
from ..package.shards import trim_heap
from ..package.speccheck import load_checked
from ..package.verify import read_manifest
from ..vision import vision_bucket
from ..weights import bundle_adapters
from .expected import ExpectedWeights

__all__ = ["CheckReport", "Executor", "Quality", "Stage", "EXEC_BOUNDS", "HEAD_BOUNDS", "MARGIN_SIGMAS", "MIN_DECISIVE",
           "check_package", "run_check", "pcc", "normalised_error", "recorded_checkpoint"]

#: the reference runs the prompt in calls of this many tokens (attention scores: heads x this x
#: context), and each decode step as a call of its own
REFERENCE_CHUNK = 128
#: prompt positions whose next-token predictions are compared, at most (evenly spaced, the first
#: and last included; every decode step is compared too): the logits of a position are a
#: vocabulary of floats per side (128,256 x 4 B for Llama 3), so comparing every position of a
#: 5,000-token prompt held ~5 GB; the stages' errors still cover every position
MAX_PROMPT_POSITIONS = 256


@dataclass
class CheckReport:
    """Both verdicts of one check (docs/check.md): ``executor`` (the emulated mesh against the
    expected run) and ``quality`` (the package against the original checkpoint), and the
    per-layer PCC against the original (``drift``: where storage error accumulates)."""

    bundle: str
    mesh: str
    dtype: str
    prompt_len: int
    steps: int
    executor: Executor
    quality: Quality
    #: per (step, layer): PCC of the emulated residual stream against the original checkpoint's
    drift: list = field(default_factory=list)
    shapes_run: list = field(default_factory=list)
    #: the package's storage: {"weights": {dtype: tensors}, "kv_cache": dtype}
    storage: dict = field(default_factory=lambda: {"weights": {"bf16": 1}, "kv_cache": "bf16"})
    kv_blocks: int = 0  # KV cache blocks the check allocated
    continuation: list = field(default_factory=list)  # the tokens fed as decode steps (teacher forcing)
    prompt: list = field(default_factory=list)  # the prompt's tokens
    #: the sequence position of each compared index (prompt positions, then every decode step)
    positions: list = field(default_factory=list)
    #: the original checkpoint's and the package's next-token predictions at each compared index
    ref_tokens: list = field(default_factory=list)
    emu_tokens: list = field(default_factory=list)
    reference: str = ""
    #: wall seconds: each side's decoder layers (weights read and run; ``emulated`` the mesh's
    #: own, ``expected``/``original`` transformers'), ``outside`` them (embeddings, heads,
    #: recordings, judging), ``total``, and ``emulated_over_original`` (the layers' ratio)
    timings: dict = field(default_factory=dict)
    #: the prefill chunk the prompt ran in (check's default prompt: :func:`default_prompt`)
    prefill_chunk: int = 0

    @property
    def quantized(self) -> str | None:
        """The coarsest block-float format the package stores (weights or KV), else None."""
        return coarsest(self.storage)

    @property
    def storage_class(self) -> str:
        return self.quantized or "bf16"

    def step_of(self, p: int) -> str:
        """The step label of compared index ``p``."""
        position = self.positions[p]
        return "prefill" if position < self.prompt_len else f"decode {position - self.prompt_len + 1}"

    @property
    def passed(self) -> bool:
        """Both verdicts (quality: where it is judged)."""
        return self.executor.passed and self.quality.passed

    def failure(self) -> str | None:
        """The executor's failure, else the quality's, in one line; None when it passes."""
        why = self.executor.failure(self.step_of)
        if why:
            return f"executor: {why}"
        if self.quality.misses():
            return (f"quality ({self.storage_class} storage, teacher-forced on {self.quality.text}): "
                    + "; ".join(self.quality.misses()) + " (targets: the spec's quality."
                    f"{self.storage_class}, docs/check.md)")
        return None

    @property
    def layers(self) -> list:
        """The executor's stages."""
        return self.executor.stages

    @property
    def routing(self) -> dict | None:
        """MoE: both sides' expert choices compared (the expected side's and the emulated's)."""
        return self.executor.routing

    @property
    def tokens_agree(self) -> bool:
        """The executor's decisive predictions all identical."""
        return self.executor.tokens_agree

    @property
    def first_token_divergence(self) -> int | None:
        """The first compared index whose prediction differs from the original checkpoint's."""
        return next((i for i, (a, b) in enumerate(zip(self.ref_tokens, self.emu_tokens)) if a != b), None)

    def diverging(self) -> Stage | None:
        return self.executor.first_wrong()

    def to_json(self) -> dict:
        return {
            "bundle": self.bundle, "mesh": self.mesh, "dtype": self.dtype, "passed": self.passed,
            "failure": self.failure(), "prompt_len": self.prompt_len, "steps": self.steps,
            "reference": self.reference,
            "executor": self.executor.to_json(self.step_of), "quality": self.quality.to_json(),
            "drift": [dict(d) for d in self.drift],
            "prompt": self.prompt, "continuation": self.continuation, "compared_positions": len(self.positions),
            "positions": self.positions, "ref_tokens": self.ref_tokens, "emulated_tokens": self.emu_tokens,
            "shapes_run": [list(s) for s in sorted(self.shapes_run)], "prefill_chunk": self.prefill_chunk,
            "storage": self.storage, "quantized": self.quantized, "kv_blocks": self.kv_blocks,
            "timings": self.timings,
        }


def run_check(bundle, mesh: str, steps: int = 32, dtype: str = "fp32", random_weights: bool = False,
              seed: int = 0, prompt_len: int | None = None, device: str = "cpu",
              package_hook=None, images: list | None = None, text: str | None = None,
              checkpoint_hook=None) -> CheckReport:
    """``ttbundle check SPEC --mesh M``: build the package into a temporary directory, then
    check that package (:func:`check_package`). With ``random_weights`` the checkpoint is a
    random instance of the architecture, saved (bf16) beside it. ``checkpoint_hook(dir)`` runs
    before the build (tests plant outliers in the checkpoint there), ``package_hook(pkg_dir)``
    between the build and the check (tests mutate the package there)."""
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
        if checkpoint_hook is not None:
            checkpoint_hook(src)
        w = bundle.spec.weights.model_copy(update={"source": str(src.absolute())})
        # random weights come without a tokenizer: the temporary package is token ids only
        b = dataclasses.replace(bundle, spec=bundle.spec.model_copy(
            update={"weights": w, **({"tokenizer": False} if random_weights else {})}))
        res = build(b, mesh, tmp / "out", warmup=False)
        if package_hook is not None:
            package_hook(Path(res.package))
        return check_package(res.package, src, steps=steps, dtype=dtype, seed=seed, prompt_len=prompt_len,
                             device=device, images=images, text=text)


def text_tokens(pkg, text: str | None) -> tuple[list[int] | None, str]:
    """The check's text as token ids with the package's own tokenizer (``text`` None: the shipped
    public-domain text, :func:`quality.default_text`), and what it was; (None, why) for a package
    without a tokenizer (token ids only: the prompt is then random tokens)."""
    names = [p.name for p in Path(pkg.dir).iterdir()]
    if not has_tokenizer(names):
        if text is not None:
            raise InvalidInput(f"{pkg.dir}: the package has no tokenizer (token ids only), so --text cannot "
                               f"be read; build it with one")
        return None, "random tokens (the package has no tokenizer)"
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(pkg.dir), local_files_only=True)
    what = "ttbundle/data/quality.txt (public domain)" if text is None else "--text"
    ids = tok(default_text() if text is None else text, verbose=False)["input_ids"]  # no max-length warning
    return [int(i) for i in ids], what


def check_package(pkg_dir, reference_dir, steps: int = 32, dtype: str = "fp32", seed: int = 0,
                  prompt_len: int | None = None, device: str = "cpu", images: list | None = None,
                  text: str | None = None) -> CheckReport:
    """``ttbundle check PACKAGE_DIR`` (module docstring): three sides, one decoder layer of each
    in memory at a time. The emulated mesh runs the package's programs on its own bytes; the
    *expected* side runs transformers, stage by stage, on the emulated side's input to that
    stage, with the checkpoint in ``reference_dir`` stored as the package declares
    (``check.expected``) and its KV cache stored as the package's is; the *original* side runs
    transformers on the checkpoint itself (rounded to bf16, the package's finest storage) over
    the whole sequence, for the quality verdict."""
    import torch

    from ..backends.emulated import EmulatedModel, Runner

    if dtype not in ("fp32", "bf16"):
        raise InvalidInput(f"--dtype {dtype!r}: use fp32 or bf16")
    tdtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    pkg = load_checked(pkg_dir, verify=True)
    bundle = pkg.bundle
    rt = bundle.spec.runtime
    kv_dtype = rt.kv_cache_dtype

    b = bundle.buckets
    chunk = run_chunk = b.prefill_chunk or max(b.prefill)
    ids, text_what = (None, "images") if images else text_tokens(pkg, text)
    if prompt_len is None:
        prompt_len, run_chunk = default_prompt(b, rt.max_model_len, steps)
        if images:  # an image must lie within one chunk: the package's own
            run_chunk = chunk
        if ids is not None:
            prompt_len = max(1, min(prompt_len, len(ids) - (steps - 1)))
    if prompt_len < 1 or prompt_len + steps > rt.max_model_len:
        raise InvalidInput(f"prompt of {prompt_len} + {steps} steps must fit max_model_len={rt.max_model_len}")
    if ids is not None and len(ids) < prompt_len + steps - 1:
        raise InvalidInput(f"the text has {len(ids)} tokens; a prompt of {prompt_len} + {steps - 1} teacher-forced "
                           f"steps needs {prompt_len + steps - 1}: give a longer --text, or fewer --steps or "
                           f"--prompt-len")
    g = torch.Generator().manual_seed(seed + 1)
    if ids is not None:
        prompt = ids[:prompt_len]
    else:
        prompt = torch.randint(0, bundle.arch.vocab_size, (prompt_len,), generator=g).tolist()
    mm, inputs, rope, delta = None, None, None, 0
    part = bundle.family.vision_part(bundle.arch)  # the family's vision part owns what differs
    if images:
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
    if ids is not None:  # natural text: the text's own next tokens
        cont = ids[prompt_len:prompt_len + steps - 1]
    else:
        cont = continuation(prompt, steps - 1, () if part is None else set(part.special_tokens()) | {part.placeholder()})
    seq = prompt + cont
    labels = ["prefill"] * prompt_len + [f"decode {i}" for i in range(1, steps)]
    segments = reference_segments(prompt_len, len(seq), [] if mm is None else mm["positions"])
    kv_ref = kv_dtype if kv_dtype in ("bf16", "bfp8") else None

    # the original: transformers' skeleton of the checkpoint; the expected: the same skeleton
    # loading the checkpoint as the package stores it. One layer materialized at a time.
    adapters = bundle_adapters(bundle)  # the LoRA adapters the build merged (bundle.yaml records them)
    ref = reference.LayerwiseModel(reference_dir, tdtype, device, "bf16" if kv_dtype == "bf16" else None,
                                   adapters=adapters)
    # the expected side computes in float32 whatever the emulated side's dtype: it gives the
    # package's numbers as exactly as they can be had, so a stage's error is the emulated
    # side's own rounding (what the compute dtype's bound allows), not the sum of two bf16
    # implementations' (transformers' eager bf16 attention rounds its scores to bf16 first)
    exp = reference.LayerwiseModel(reference_dir, torch.float32, device, kv_ref,
                                   weights=ExpectedWeights(pkg, reference_dir), adapters=adapters)
    n_layers = len(ref.layers)
    router = bundle.family.hf_router
    # layer -> [set of experts per token] in sequence order; the expected router's logits per
    # token (a layer's, until it is judged); the positions judged apart per layer
    routes: dict = {"hf": {}, "emu": {}, "hf_logits": {}, "apart": {}}
    hooks = []

    def hf_routed(li, o):  # a transformers router's (logits, weights, indices) for its tokens
        routes["hf"].setdefault(li, []).extend(set(r) for r in o[2].tolist())
        if dtype != "bf16":  # only fp32 reads them (a flip is judged apart at a tie)
            routes["hf_logits"].setdefault(li, []).extend(o[0].detach().float().reshape(-1, o[0].shape[-1]).cpu())
    if router:
        for li, layer in enumerate(exp.layers):
            for m in layer.modules():
                if type(m).__name__ == router[0]:
                    hooks.append(m.register_forward_hook(
                        lambda m, i, o, li=li: hf_routed(li, o)))
    image_exp = []
    kw = {} if mm is None else part.reference_kwargs(seq, inputs, device)
    h_ref, ref_calls = ref.record(seq, segments, kw, images=mm is not None)
    inputs32 = None if inputs is None else {k: x.float() if x.is_floating_point() else x for k, x in inputs.items()}
    kw32 = {} if mm is None else part.reference_kwargs(seq, inputs32, device)
    h_exp0, exp_calls = exp.record(
        seq, segments, kw32, images=mm is not None, on_vision=None if mm is None else
        lambda: image_exp.append(part.reference_features(exp.model, inputs32, device).float().cpu()))

    kernels = None
    if router:
        from ..backends.emulated.kernel_table import KERNELS
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
    runner.chunk = run_chunk
    blocks = list(range(1, need + 1))
    stages: list = []
    drift: list = []
    flips: list = []
    #: seconds: each side's decoder layers (weights read, run, judged apart), and the rest
    #: (``outside``: the emulated embedding and head, the judging, the three heads)
    timings = {"emulated": 0.0, "expected": 0.0, "original": 0.0}
    t_start = time.perf_counter()
    mark = [t_start]  # when the emulated side's current stage began

    def free():
        model.release()  # closes the package's files too: what was read does not stay resident
        trim_heap()

    def local(out, emu, inp, layer, stage, flipped=frozenset()):
        """Per step: the prompt's positions together, each decode step's alone. ``flipped``: the
        positions whose token took other experts on the two sides in this layer (bf16: any;
        fp32: a ``router_tie``): judged apart, against FLIP_BOUND_BF16; the rest of the step
        against the bound."""
        for lab in dict.fromkeys(labels):
            idx = [i for i, x in enumerate(labels) if x == lab]
            a, z = idx[0], idx[-1] + 1
            r, e = out[a:z], emu[a:z]
            x = None if inp is None else inp[a:z]
            keep = [i - a for i in idx if i not in flipped]
            away = [i - a for i in idx if i in flipped]
            err = normalised_error(r[keep], e[keep], None if x is None else x[keep], dtype) if keep else 0.0
            ferr = normalised_error(r[away], e[away], None if x is None else x[away], dtype) if away else None
            stages.append(Stage(lab, layer, stage, err, float((r - e).abs().max()), pcc(r, e), len(away), ferr))

    with torch.no_grad():
        if mm is not None:  # the package's vision program against transformers' image features
            mm["embeds"] = model.encode_images(inputs["pixel_values"].to(device), inputs.get("image_grid_thw"))
            free()
            vb, _ = vision_bucket(part, sorted(b for ph, b in model.programs if ph == "vision"),
                                  inputs["pixel_values"], inputs.get("image_grid_thw"))
            runner.shapes_run.add(("vision", vb))
            e = mm["embeds"].float().cpu()
            stages.append(Stage("image", -1, "image", normalised_error(image_exp[0], e, None, dtype),
                                float((image_exp[0] - e).abs().max()), pcc(image_exp[0], e)))
        sel = compared_prompt_positions(prompt_len)
        idx = sel + list(range(prompt_len, len(seq)))
        calls = runner.prefill_calls(prompt, blocks, capture=True, mm=mm, rope_positions=rope, head_rows=sel)
        n_pre = len(calls)
        calls += [runner.decode_call([t], [prompt_len + i], [blocks], capture=True,
                                     rope_deltas=None if rope is None else [delta]) for i, t in enumerate(cont)]
        prev = None  # the emulated side's output of the stage before: the expected side's input

        def captured():
            rows = [c.capture.pop(0) for c in calls]
            if any(r is None for r in rows):
                return None
            return torch.cat([r[0, :c.rows] if k < n_pre else r[:c.rows, 0]
                              for k, (r, c) in enumerate(zip(rows, calls))]).float().cpu()

        def after(stage):
            nonlocal h_ref, prev
            kind, li = stage
            if li is not None:
                timings["emulated"] += time.perf_counter() - mark[0]
            free()
            if kind == "embedding":
                prev = captured()
                if prev is not None:
                    local(h_exp0[0].float().cpu(), prev, None, -1, "embed")
                else:  # the embedding leaves h split: layer 0 reads the expected side's own
                    prev = h_exp0[0].float().cpu()
                return
            if li is None:
                return
            emu = captured()
            t0 = time.perf_counter()
            out = exp.run_layer(li, prev[None].to(device=device, dtype=torch.float32), exp_calls[li])[0].float().cpu()
            trim_heap()
            timings["expected"] += time.perf_counter() - t0
            flipped = frozenset()
            if router and li in routes["hf"]:
                rows = routes["emu"].pop(li, [])
                routes["emu"][li] = sum((r[:c.rows] for r, c in zip(rows, calls)), [])
                # judged apart: in bf16 any position routed apart, in fp32 a tie (verdict.router_tie)
                flipped = frozenset(p for p, (x, y) in enumerate(zip(routes["hf"][li], routes["emu"][li]))
                                    if x != y and (dtype == "bf16" or router_tie(routes["hf_logits"][li][p], x, y)))
                routes["apart"][li] = flipped
                routes["hf_logits"].pop(li, None)
            local(out, emu, prev, li, "layer", flipped)
            t0 = time.perf_counter()
            h_ref = ref.run_layer(li, h_ref, ref_calls[li])
            trim_heap()
            timings["original"] += time.perf_counter() - t0
            for lab in dict.fromkeys(labels):
                ix = [i for i, x in enumerate(labels) if x == lab]
                drift.append({"step": lab, "layer": li, "pcc": pcc(h_ref[0, ix[0]:ix[-1] + 1].float().cpu(),
                                                                     emu[ix[0]:ix[-1] + 1])})
            prev = emu

        def timed(stage):
            after(stage)
            mark[0] = time.perf_counter()
        out = model.run_layer_major(calls, after_stage=timed)
        wanted = set(sel)
        emu_logits = torch.cat([lg[0, [r for r, j in enumerate(c.head_rows) if j in wanted]] if k < n_pre
                                else lg[:c.rows, 0] for k, (lg, c) in enumerate(zip(out, calls))]).float().cpu()
        del out
        exp_logits = exp.head(prev[idx][None].to(device=device, dtype=torch.float32))[0].float().cpu()
        ref_logits = ref.head(h_ref[:, idx])[0].float().cpu()
    for h in hooks:
        h.remove()
    head_labels = [labels[j] for j in idx]
    for lab in dict.fromkeys(head_labels):
        ix = [i for i, x in enumerate(head_labels) if x == lab]
        r, e = exp_logits[ix[0]:ix[-1] + 1], emu_logits[ix[0]:ix[-1] + 1]
        stages.append(Stage(lab, n_layers, "head", normalised_error(r, e, None, dtype), float((r - e).abs().max()),
                            pcc(r, e)))
    order = {lab: i for i, lab in enumerate(dict.fromkeys(labels))}
    stages.sort(key=lambda s: (-1 if s.step == "image" else order[s.step], STAGE_ORDER[s.stage], s.layer))
    routing = None
    if router:
        routing = _routing(routes, labels)
        flips = [tuple(f) for f in routing["flips"]]
    top2 = exp_logits.topk(2, dim=-1).values
    bound = HEAD_BOUNDS[dtype]
    ex = Executor(dtype, stages, exp_logits.argmax(-1).tolist(), emu_logits.argmax(-1).tolist(),
                  (top2[:, 0] - top2[:, 1]).tolist(),
                  (MARGIN_SIGMAS * bound * exp_logits.double().std(dim=-1)).tolist(), flips, routing)
    nxt = [seq[q + 1] if q + 1 < len(seq) else -1 for q in idx]
    storage = storage_of(pkg)
    quantized = coarsest(storage) or "bf16"
    q = Quality(**measure(ref_logits, emu_logits, nxt), storage=quantized,
                targets=targets_for(bundle, quantized), natural_text=ids is not None, text=text_what)
    return CheckReport(bundle.spec.name, pkg.mesh.name, dtype, prompt_len, steps, ex, q, drift=drift,
                       shapes_run=sorted(runner.shapes_run), storage=storage, kv_blocks=runner.kv.num_blocks,
                       continuation=cont, prompt=prompt, positions=idx, ref_tokens=ref_logits.argmax(-1).tolist(),
                       emu_tokens=emu_logits.argmax(-1).tolist(), reference=str(reference_dir),
                       timings=_timings(timings, time.perf_counter() - t_start), prefill_chunk=runner.chunk)


#: the longest prefill chunk check's *default* prompt runs (docs/check.md, "The default
#: prompt"): three sides run every decoder layer over the whole prompt in float32, so the
#: prompt's length sets check's time; chunked prefill (a call reading the KV an earlier call
#: wrote, in every layer) runs at this chunk as at the package's own, and ``--prompt-len``
#: longer than this runs the package's own chunking (its chunk program included)
CHECK_CHUNK = 1024


def default_prompt(buckets, max_model_len: int, steps: int) -> tuple[int, int]:
    """``(tokens, chunk)`` of check's default prompt: a bit over one chunk, so chunked prefill
    runs. A package chunk up to :data:`CHECK_CHUNK` (or no smaller bucket): that chunk and a
    third of it more. A longer one: chunks of the largest prefill bucket up to CHECK_CHUNK, and the
    smallest bucket after it (every call's rows real: no padded rows computed; the chunk
    twice where it is the smallest bucket)."""
    chunk = buckets.prefill_chunk or max(buckets.prefill)
    fit = [x for x in buckets.prefill if x <= CHECK_CHUNK]
    if chunk <= CHECK_CHUNK or not fit:
        return max(1, min(chunk + chunk // 3 + 1, max_model_len - steps - 1)), chunk
    c = max(fit)
    tail = min(buckets.prefill)  # c itself where no bucket is smaller: two whole chunks
    return max(1, min(c + tail, max_model_len - steps - 1)), c


def _timings(layers: dict, total: float) -> dict:
    """``check --json``'s ``timings``: each side's decoder layers, the rest and the total (s)."""
    return {k: round(v, 2) for k, v in layers.items()} | {
        "outside": round(total - sum(layers.values()), 2), "total": round(total, 2),
        "emulated_over_original": None if not layers["original"]
        else round(layers["emulated"] / layers["original"], 2)}


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


def recorded_checkpoint(pkg_dir) -> Path:
    """The checkpoint a package was built from, as its manifest records it (``sources.weights``),
    if it is still there unchanged: the build's own test (``cache.source_records``: a digest is
    reused while size, mtime and inode match, else the file is hashed again with BLAKE3)."""
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


def coarsest(storage: dict) -> str | None:
    """The coarsest block-float format of a :func:`storage_of` record (weights or KV), else None."""
    fmts = set(storage["weights"]) | {storage["kv_cache"]}
    return "bfp4" if "bfp4" in fmts else "bfp8" if "bfp8" in fmts else None


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
            "flipped_positions": sorted(positions),
            "judged_apart": sum(len(v) for v in routes["apart"].values())}
