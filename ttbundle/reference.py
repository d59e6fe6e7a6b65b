"""Hugging Face transformers as the numerical reference: the same weights, the same tokens."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

from .errors import InvalidInput
from . import blockfloat
from .weights import Checkpoint

# MoE experts as the modeling file writes them (a loop over the chosen experts), not transformers'
# default batched grouped_mm: the reference is the plain implementation
EXPERTS = "eager"


def hf_config(bundle):
    import transformers

    d = bundle.family.to_hf_config(bundle.arch)
    model_type = d.pop("model_type")
    try:
        return transformers.AutoConfig.for_model(model_type, **d)
    except (ValueError, KeyError) as e:
        raise InvalidInput(f"transformers cannot build a {model_type!r} config: {e}") from None


def auto_class(model_type: str):
    """transformers' auto class for a model type: the causal LM one, or the image-text-to-text
    one for multimodal models transformers registers only there (Qwen2.5-VL)."""
    import transformers
    from transformers.models.auto import modeling_auto as m

    if model_type not in m.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type in m.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def random_model(bundle, seed: int = 0, dtype=None):
    """A tiny-or-not HF model of the bundle's architecture with random weights scaled so that
    activations stay O(1) and greedy tokens vary (HF's own init makes near-constant outputs)."""
    import torch
    import transformers

    cfg = hf_config(bundle)
    # eager attention: transformers' SDPA path ignores Gemma 2's attn_logit_softcapping
    model = auto_class(cfg.model_type).from_config(
        cfg, dtype=torch.float32, attn_implementation="eager", experts_implementation=EXPERTS).eval()
    g = torch.Generator().manual_seed(seed)
    traits = bundle.family.traits(bundle.arch)
    neutral = 0.0 if traits.get("norm_offset") else 1.0
    # scaled embeddings (Gemma) must not swamp the layers, or tied logits repeat the input token
    embed_std = 0.5 / (traits.get("embed_scale") or 1.0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                fan_in = p.shape[-1]
                scale = embed_std if "embed" in name else 1.0 / math.sqrt(fan_in)
                p.copy_(torch.randn(p.shape, generator=g) * scale)
            elif name.endswith("bias"):
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
            else:  # norm weights around their neutral value; sinks and biases around 0
                base = 0.0 if ("sinks" in name or "bias" in name) else neutral
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
        persistent = set(model.state_dict())
        for name, b in model.named_buffers():  # checkpoint buffers: DeepSeek's e_score_correction_bias
            if name in persistent and b.is_floating_point():
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    if dtype is not None:
        model = model.to(dtype)
    return model


def _quiet() -> None:
    """No progress bars from transformers: the CLI prints its own report (and --json)."""
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()


def load_model(directory: str | Path, dtype=None):
    import torch
    import transformers

    _quiet()
    try:
        cfg = transformers.AutoConfig.from_pretrained(str(directory), local_files_only=True)
        return auto_class(cfg.model_type).from_pretrained(
            str(directory), dtype=dtype or torch.float32, local_files_only=True,
            attn_implementation="eager", experts_implementation=EXPERTS).eval()
    except (OSError, ValueError) as e:
        raise InvalidInput(f"{directory}: transformers cannot load it as a causal LM: {e}") from None


def checkpoint_state_dict(model) -> dict:
    """``model``'s tensors under their checkpoint names and layout, as ``save_pretrained`` writes
    them: transformers 5 fuses some in memory (DeepSeek's per-expert projections into one
    ``gate_up_proj``), the family name tables read checkpoints."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, model.state_dict())


def save_random(bundle, directory: str | Path, seed: int = 0, eos: bool = True) -> Path:
    """A random instance of the bundle's architecture (:func:`random_model`) saved as a bf16
    checkpoint (``config.json`` + safetensors), as a published checkpoint would be. Without
    ``eos`` its configs name no eos token (``generate`` then runs to max_new_tokens)."""
    import torch

    _quiet()
    d = Path(directory)
    model = random_model(bundle, seed).to(torch.bfloat16)
    if not eos:
        model.config.eos_token_id = None
        model.generation_config.eos_token_id = None
    model.save_pretrained(d)
    return d


def round_to_bf16(model) -> None:
    """Round every floating parameter and persistent buffer to the nearest bf16 value (kept in
    its dtype): the weights a package holds at its finest storage (bf16)."""
    import torch

    with torch.no_grad():
        persistent = set(model.state_dict())
        for name, t in list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers() if n in persistent]:
            if t.is_floating_point() and t.dtype != torch.bfloat16:
                t.copy_(t.to(torch.bfloat16).to(t.dtype))


def kv_cache(model, storage: str | None = None):
    """A transformers cache for ``model`` that stores keys and values as a device cache of
    dtype ``storage`` holds them (``"bf16"``: rounded to bf16 on every write, as ttbundle's
    emulated cache does; ``"bfp8"``/``"bfp4"``: each head's row of a token rounded as a
    block-float tile row stores it, one shared exponent per 16 values, as the emulated cache
    does); ``None``: transformers' own cache in the compute dtype."""
    import torch
    from transformers.cache_utils import DynamicCache

    if storage is None:
        return DynamicCache(config=model.config)
    if storage not in ("bf16", "bfp8", "bfp4"):
        raise ValueError(f"reference KV storage {storage!r}: bf16, bfp8 or bfp4")

    def store(x):
        if storage == "bf16":
            return x.to(torch.bfloat16).to(x.dtype)
        q = blockfloat.quantize(x.detach().float().cpu().reshape(-1, x.shape[-1]), storage)
        return q.reshape(x.shape).to(device=x.device, dtype=x.dtype)

    class RoundingCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return super().update(store(key_states), store(value_states), layer_idx, *args, **kwargs)

    return RoundingCache(config=model.config)


# ---- transformers one layer at a time -------------------------------------------------------------
class _Recorded(Exception):
    """Raised by the last layer's recorder: the recording forward has what it needs."""


def _params_on_meta():
    """A context in which every parameter a module registers goes to the ``meta`` device (no
    memory, no init) while buffers stay real (rotary tables, embedding scales): transformers'
    skeleton of a model of any size. Parameters are made from ``torch.empty`` (``nn.Linear``,
    ``nn.Embedding``, the fused experts' ``[E, ...]`` stacks): inside it ``torch.empty`` makes
    meta tensors, so a parameter is never allocated, not even before it moves to ``meta`` (the
    fused float32 experts of a DeepSeek-V3 layer are 30 GB); buffers are computed (``arange``,
    ``zeros`` ...) and stay real."""
    import torch
    from torch.overrides import TorchFunctionMode

    class EmptyOnMeta(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.empty and kwargs.get("device") in (None, "cpu", torch.device("cpu")):
                kwargs = {**kwargs, "device": "meta"}
            return func(*args, **kwargs)

    @contextlib.contextmanager
    def ctx():
        register = torch.nn.Module.register_parameter

        def on_meta(module, name, param):
            register(module, name, param)
            if param is not None and param.device.type != "meta":
                p = module._parameters[name]
                module._parameters[name] = torch.nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)
        torch.nn.Module.register_parameter = on_meta
        try:
            with EmptyOnMeta():
                yield
        finally:
            torch.nn.Module.register_parameter = register
    return ctx()


#: vocabulary rows of the LM head read at a time (:meth:`LayerwiseModel.head`)
HEAD_ROWS = 8192


class LayerwiseModel:
    """transformers' model of a checkpoint, never whole in memory: a skeleton whose parameters
    are on the ``meta`` device, and the parts a step needs read from the (memory-mapped)
    safetensors through transformers' own key renamings and weight conversions (those that
    fuse MoE experts in memory), rounded to bf16 (:func:`round_to_bf16`) and freed after.

    A routed-experts module is never loaded whole: :meth:`run_layer` runs its own eager forward
    with one expert's parameters loaded at a time (:class:`_StreamedExperts`).

    :meth:`record` runs the model's own forward over a token sequence with every decoder layer
    replaced by a recorder of its arguments (masks of each attention type, position embeddings,
    M-RoPE positions ...), holding only the rows of the embedding the sequence uses (and the
    vision tower, for images); :meth:`run_layer` then runs one decoder layer, materialized, over
    the whole sequence with a cache of its own (``kv_storage``: :func:`kv_cache`);
    :meth:`head` the final norm, LM head and final logit soft-capping."""

    def __init__(self, directory: str | Path, dtype=None, device="cpu", kv_storage: str | None = None,
                 weights=None, adapters=()):
        import torch
        import transformers

        _quiet()
        self.dir = Path(directory)
        self.dtype = dtype or torch.float32
        self.device = torch.device(device)
        self.kv_storage = kv_storage
        #: ``weights(key)``: the tensor to load for checkpoint ``key`` instead of the file's, or
        #: None (``check``'s expected run: the checkpoint as a package stores it); its
        #: ``lm_head_bands()`` the LM head's bands and ``expert(key, e)`` one routed expert's
        #: part of ``key`` likewise (``check.expected.ExpectedWeights``)
        self.weights = weights

        # the checkpoint as its format decodes it (``formats``), LoRA ``adapters`` merged: what
        # the build converts
        self.ck = Checkpoint(self.dir, adapters=adapters)
        try:
            cfg = transformers.AutoConfig.from_pretrained(str(directory), local_files_only=True)
            for c in (cfg, getattr(cfg, "text_config", None)):
                if getattr(c, "quantization_config", None) is not None:  # dense weights: no quantizer
                    del c.quantization_config
            with _params_on_meta():
                model = auto_class(cfg.model_type).from_config(
                    cfg, dtype=torch.float32, attn_implementation="eager", experts_implementation=EXPERTS)
        except (OSError, ValueError) as e:
            raise InvalidInput(f"{directory}: transformers cannot load it as a causal LM: {e}") from None
        self.model = model.eval()
        _apply_real(self.model, self.dtype, self.device)  # the buffers, as model.to(dtype) would
        self.layers, self.layers_name = _layers(model)
        names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
        self.embed = model.get_input_embeddings()
        self.embed_name = names[id(self.embed)]
        self.lm_head = model.get_output_embeddings()
        self.norm = model.get_submodule(self.layers_name.rpartition(".")[0]).norm
        self.norm_name = names[id(self.norm)]
        self.head_name = names[id(self.lm_head)]
        self._index()

    def _conversions(self):
        from transformers.conversion_mapping import get_model_conversion_mapping
        return get_model_conversion_mapping(self.model, None, None)

    def _index(self) -> None:
        """Each checkpoint tensor's file and the model parameter it loads into."""
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        conv = self._conversions()
        ren = [c for c in conv if isinstance(c, WeightRenaming)]
        cvt = [c for c in conv if isinstance(c, WeightConverter)]
        meta = self.model.state_dict()
        self.where: dict = {}
        for k in sorted(self.ck.keys()):  # a decoded or merged tensor has no file of its own (None)
            f = None if self.ck.derived(k) else self.ck.files[k]
            self.where[k] = (f, rename_source_key(k, ren, cvt, self.model.base_model_prefix, meta)[0])

    def _keys(self, prefix: str) -> list:
        return [k for k, (_, r) in self.where.items() if r == prefix or r.startswith(prefix + ".")]

    def load(self, prefix: str, keys: list | None = None, exclude=frozenset()) -> None:
        """Materialize the parameters under module ``prefix`` from the checkpoint, rounded to
        bf16: the tensors that load under it (less ``exclude``: streamed experts'), or ``keys``
        (then unchecked: the parts outside the decoder, which a text-only prompt leaves on the
        meta device)."""
        import torch
        from safetensors import safe_open

        module = self.model.get_submodule(prefix)
        check = keys is None
        keys = [k for k in self._keys(prefix) if k not in exclude] if keys is None else keys
        handles = {}
        try:
            sd = {}
            for k in keys:
                f = self.where[k][0]
                if f is None:  # decoded / merged as the build reads it
                    sd[k] = self.ck.get(k)
                else:
                    if f not in handles:
                        handles[f] = safe_open(str(f), framework="pt")
                    sd[k] = handles[f].get_slice(k)
                if self.weights is not None:
                    x = self.weights(k)
                    if x is not None:  # stored values: each exactly a bf16 value
                        sd[k] = x.to(torch.bfloat16)
            exact = self._convert(sd)
        finally:
            sd = None
            handles.clear()  # their mmaps go with them
        missing = [n for n, p in module.named_parameters() if p.device.type == "meta"] if check else []
        if missing:
            raise InvalidInput(f"{self.dir}: the checkpoint has no tensors for {prefix}."
                               f"{missing[0]} ({len(missing)} parameters missing)")
        if not exact:
            round_to_bf16(module)
        _apply_real(module, self.dtype, self.device)

    def _convert(self, sd: dict) -> bool:
        """``sd`` (checkpoint keys -> tensors or safetensors slices) loaded into the model through
        transformers' own renamings and conversions; whether its values were all bf16 already."""
        import torch
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig

        exact = all((x.dtype == torch.bfloat16) if isinstance(x, torch.Tensor) else x.get_dtype() == "BF16"
                    for x in sd.values())  # bf16 values already
        convert_and_load_state_dict_in_model(
            self.model, sd, LoadStateDictConfig(dtype=None, weight_mapping=self._conversions()))
        return exact

    def _expert_modules(self, prefix: str) -> list:
        """The routed-expert modules under ``prefix`` as :class:`_StreamedExperts` (not yet
        installed): modules with a ``num_experts`` and a 3-D parameter stacked over it (the fused
        ``gate_up_proj`` / ``down_proj`` of every MoE family transformers writes)."""
        out = []
        for n, m in self.model.get_submodule(prefix).named_modules():
            E = getattr(m, "num_experts", None)
            ps = {pn: p for pn, p in m._parameters.items() if p is not None and p.dim() >= 1 and p.shape[0] == E}
            if isinstance(E, int) and any(p.dim() >= 3 for p in ps.values()):
                name = f"{prefix}.{n}" if n else prefix
                out.append(_StreamedExperts(self, name, m, ps, self._keys(name)))
        return out

    def free(self, prefix: str) -> None:
        """Back to the meta device: the memory of the module's parameters is released."""
        import torch
        module = self.model.get_submodule(prefix)
        for m in module.modules():
            for n, p in list(m._parameters.items()):
                if p is not None and p.device.type != "meta":
                    m._parameters[n] = torch.nn.Parameter(p.to("meta"), requires_grad=False)

    def _compact_embedding(self, ids: list[int]):
        """The embedding with only the rows of ``ids`` (read from the checkpoint), its input ids
        mapped to them by a pre-hook: the table of a 128k vocabulary is never read whole."""
        import torch
        from safetensors import safe_open

        (key,) = self._keys(self.embed_name) or [None]
        if key is None:
            raise InvalidInput(f"{self.dir}: the checkpoint has no embedding ({self.embed_name}.weight)")
        uniq = sorted(set(ids))
        if self.where[key][0] is None:  # a quantized or adapted embedding
            rows = self.ck.get(key)[uniq].float()
        else:
            with safe_open(str(self.where[key][0]), framework="pt") as h:
                s = h.get_slice(key)
                rows = torch.cat([s[r:r + 1] for r in uniq]).float()
        rows = rows.to(torch.bfloat16).to(torch.float32).to(self.dtype).to(self.device)
        remap = torch.full((self.embed.num_embeddings,), -1, dtype=torch.long, device=self.device)
        remap[torch.tensor(uniq, device=self.device)] = torch.arange(len(uniq), device=self.device)
        self.embed.weight = torch.nn.Parameter(rows, requires_grad=False)
        self.embed.padding_idx = None  # (gradients only)

        def pre(module, args):
            idx = remap[args[0]]
            if bool((idx < 0).any()):
                raise RuntimeError("the embedding was read for other token ids than it is given")
            return (idx,) + tuple(args[1:])
        return self.embed.register_forward_pre_hook(pre)

    def record(self, ids: list[int], segments: list, kwargs: dict | None = None, images: bool = False,
               on_vision=None):
        """The model's own forward over ``ids``, one call per ``(start, end)`` of ``segments``
        in order (a prompt's chunks, then each decode step), with every decoder layer replaced by
        a recorder of its arguments: the masks of its attention type, position embeddings, M-RoPE
        positions, as the model computes them for that call. A recorder grows the recording
        cache by the call's length (zeros), so each call's masks see the context a real cache
        would hold. ``kwargs`` (images: pixel values, token types over ``ids``) go with the first
        call, sliced to it; every image must lie in it. ``images``: the parts outside the decoder
        (vision tower, projector) are read for the recording and ``on_vision()`` runs while they
        are. Returns (the first layer's input [1, T, hidden], per layer per call its (args,
        kwargs) after the hidden states and its length)."""
        import torch

        rest = None
        if images:
            head = (self.embed_name, self.norm_name, self.head_name)
            under = lambda r, p: r == p or r.startswith(p + ".")  # noqa: E731
            rest = [k for k, (_, r) in self.where.items()
                    if not under(r, self.layers_name) and not any(under(r, p) for p in head)]
            self.load("", rest)
        hook = self._compact_embedding(ids)
        n = len(self.layers)
        calls: list = [[] for _ in range(n)]
        original = list(self.layers)
        recorder = _make_recorder()
        for i in range(n):
            self.layers[i] = recorder(i, i == n - 1, calls)
        undo = _record_deepstack(self.model, calls)
        h0 = []
        try:
            if on_vision is not None:
                on_vision()
            cache = kv_cache(self.model, self.kv_storage)
            T = len(ids)
            for k, (a, b) in enumerate(segments):
                kw = {}
                for name, x in (kwargs or {}).items() if k == 0 else ():
                    token_aligned = isinstance(x, torch.Tensor) and x.dim() == 2 and tuple(x.shape) == (1, T)
                    kw[name] = x[:, a:b] if token_aligned else x
                with torch.no_grad():
                    try:
                        self.model.model(input_ids=torch.tensor([ids[a:b]], device=self.device),
                                         past_key_values=cache, use_cache=True, **kw)
                    except _Recorded:
                        pass
                if any(len(c) != k + 1 for c in calls):
                    raise RuntimeError(f"the recording forward reached {sum(len(c) > k for c in calls)} of "
                                       f"{n} decoder layers")
                h0.append(calls[0][k][0][0])
        finally:
            for i, layer in enumerate(original):
                self.layers[i] = layer
            undo()
            hook.remove()
            self.free(self.embed_name)
            if rest is not None:
                self.free("")
        for c in calls:
            c[:] = [(args[1:], kw, args[0].shape[1]) for args, kw in c]
        return torch.cat(h0, dim=1), calls

    def run_layer(self, i: int, h, calls: list):
        """Decoder layer ``i``, read from the checkpoint, over ``h`` [1, T, hidden]: each call
        :meth:`record` recorded for it in turn (its slice of ``h``), with one cache of its own
        (``kv_storage``) across them; freed after."""
        import torch

        prefix = f"{self.layers_name}.{i}"
        # routed experts: one expert read, converted and held at a time (as the eager experts loop
        # reaches it), never the layer's stack (issue 37)
        streamed = self._expert_modules(prefix)
        for ex in streamed:
            ex.install()
        try:
            self.load(prefix, exclude={k for ex in streamed for k in ex.keys})
        except BaseException:
            for ex in streamed:
                ex.remove()
            raise
        try:
            cache = kv_cache(self.model, self.kv_storage)
            out, a = [], 0
            for args, kw, n in calls:
                kw = dict(kw)
                deep = kw.pop(DEEPSTACK, None)
                if "past_key_values" in kw:
                    kw["past_key_values"] = cache
                with torch.no_grad():
                    y = self.layers[i](h[:, a:a + n], *args, **kw)
                y = y[0] if isinstance(y, tuple) else y
                if deep is not None:  # what the model adds after this layer (DeepStack)
                    y = deep[0](y, *deep[1:])
                out.append(y)
                a += n
            if a != h.shape[1]:
                raise RuntimeError(f"layer {i}: the recorded calls cover {a} of {h.shape[1]} positions")
            return torch.cat(out, dim=1)
        finally:
            for ex in streamed:
                ex.remove()
            self.free(prefix)

    def head(self, h):
        """The final norm, the LM head and the model's final logit soft-capping (where its
        config has one, as its ``ForCausalLM`` applies it) over ``h`` [1, T, hidden]. A plain
        LM head (no bias, no weight conversion; tied: the embedding's table) is read from the
        checkpoint ``HEAD_ROWS`` vocabulary rows at a time, so its table is never whole in
        memory; another is loaded as a module."""
        import torch
        from safetensors import safe_open

        self.load(self.norm_name)
        try:
            with torch.no_grad():
                x = self.norm(h)
        finally:
            self.free(self.norm_name)
        keys = self._keys(self.head_name) or self._keys(self.embed_name)  # tied: the table once
        plain = len(keys) == 1 and getattr(self.lm_head, "bias", None) is None and self.where[keys[0]][0] and \
            self.where[keys[0]][1] in (f"{self.head_name}.weight", f"{self.embed_name}.weight")
        bands = None if self.weights is None else self.weights.lm_head_bands()
        with torch.no_grad():
            if bands is not None:  # the LM head as stored: bands of its [hidden, vocab] rows
                logits = None
                for r0, r1, rows in bands:
                    part = x[..., r0:r1] @ rows.to(dtype=x.dtype, device=x.device)
                    logits = part if logits is None else logits.add_(part)
                    del rows, part
            elif plain:
                path = str(self.where[keys[0]][0])
                with safe_open(path, framework="pt") as f:
                    V = f.get_slice(keys[0]).get_shape()[0]
                logits = torch.empty(*x.shape[:-1], V, dtype=x.dtype, device=x.device)
                for a in range(0, V, HEAD_ROWS):
                    # the file opened per band: its mapped pages leave with the band (an open
                    # mmap keeps every page read so far resident, the whole table by the end)
                    with safe_open(path, framework="pt") as f:
                        W = f.get_slice(keys[0])[a:a + HEAD_ROWS]
                    W = W.to(torch.bfloat16).to(torch.float32).to(x.dtype).to(x.device)
                    logits[..., a:a + W.shape[0]] = torch.nn.functional.linear(x, W)
            else:
                self.load(self.head_name)
                try:
                    logits = self.lm_head(x)
                finally:
                    self.free(self.head_name)
            cap = getattr(self.model.config, "final_logit_softcapping", None)
            if cap:
                logits = torch.tanh(logits / cap) * cap
        return logits


class _Rows:
    """Stands in for a fused expert parameter ``[E, ...]`` in an experts module's eager forward,
    which reads it as ``param[expert_idx]``: that expert's slice, loaded on demand."""

    def __init__(self, owner: "_StreamedExperts", name: str):
        self.owner, self.name = owner, name

    def __getitem__(self, idx):
        return self.owner.expert(int(idx))[self.name]


class _StreamedExperts:
    """A routed-experts module of one decoder layer run with its experts read one at a time:
    its fused parameters replaced by :class:`_Rows` (the module's own forward, its router and
    its routing unchanged), each expert's checkpoint tensors (a per-expert key, or rows of a
    stacked one: ``Checkpoint.get_rows`` decodes MXFP4 / FP8 for those rows only) loaded through
    transformers' own renamings and conversions into one-expert parameters, rounded as a whole
    layer's load rounds them, and held until the forward asks for another expert."""

    def __init__(self, lm: "LayerwiseModel", name: str, module, params: dict, keys: list):
        self.lm, self.name, self.module = lm, name, module
        self.shapes = {n: tuple(p.shape) for n, p in params.items()}
        self.keys = list(keys)
        self.E = module.num_experts
        self.current, self.e = None, None

    def install(self) -> None:
        import torch
        for n in self.shapes:
            self.module._parameters.pop(n, None)
            object.__setattr__(self.module, n, _Rows(self, n))
        self._torch = torch

    def remove(self) -> None:
        import torch
        for n, shape in self.shapes.items():
            self.module.__dict__.pop(n, None)
            self.module._parameters[n] = torch.nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False)
        self.current, self.e = None, None

    def _expert_of(self, key: str):
        """The expert a per-expert checkpoint key holds (its last numeric component after the
        layer's), or None for a tensor stacked over every expert."""
        nums = [int(p) for p in key.split(".") if p.isdigit()]
        return nums[-1] if len(nums) >= 2 else None

    def _rows(self, key: str, e: int):
        from safetensors import safe_open

        lm = self.lm
        if lm.weights is not None:
            x = lm.weights.expert(key, e)
            if x is not None:  # stored values (bf16 exactly): this expert's rows
                return x.to(self._torch.bfloat16)
        f = lm.where[key][0]
        if f is None:  # decoded / merged: only this expert's rows decoded
            return lm.ck.get_rows(key, e, e + 1)
        with safe_open(str(f), framework="pt") as h:
            return h.get_slice(key)[e:e + 1]

    def expert(self, e: int) -> dict:
        """Expert ``e``'s parameters (each the fused parameter's slice ``[e]``)."""
        if self.e == e:
            return self.current
        torch, lm = self._torch, self.lm
        self.current = None
        sd = {}
        for k in self.keys:
            x = self._expert_of(k)
            if x is None:
                sd[k] = self._rows(k, e)
            elif x == e:  # renumbered: this expert is the one-expert module's expert 0
                parts = k.split(".")
                i = max(j for j, p in enumerate(parts) if p.isdigit())
                x = lm.weights.expert(k, e) if lm.weights is not None else None
                # stored values (bf16 exactly), or the checkpoint's tensor as its format decodes it
                x = lm.ck.get(k) if x is None else x.to(torch.bfloat16)
                sd[".".join(parts[:i] + ["0"] + parts[i + 1:])] = x
        m = self.module
        for n, shape in self.shapes.items():
            m.__dict__.pop(n, None)
            m._parameters[n] = torch.nn.Parameter(torch.empty((1, *shape[1:]), device="meta"), requires_grad=False)
        try:
            exact = lm._convert(sd)
            sd = None
            missing = [n for n in self.shapes if m._parameters[n].device.type == "meta"]
            if missing:
                raise InvalidInput(f"{lm.dir}: the checkpoint has no tensors for {self.name}.{missing[0]} "
                                   f"of expert {e}")
            if not exact:
                round_to_bf16(m)
            _apply_real(m, lm.dtype, lm.device)
            self.current = {n: m._parameters[n][0] for n in self.shapes}
        finally:
            for n in self.shapes:
                m._parameters.pop(n, None)
                object.__setattr__(m, n, _Rows(self, n))
        self.e = e
        return self.current


#: the key of a recorded call's DeepStack addition (``_record_deepstack``)
DEEPSTACK = "__deepstack__"


def _record_deepstack(model, calls: list):
    """Where the text model adds features to the hidden states between its decoder layers
    (Qwen3-VL's DeepStack, its ``_deepstack_process(h, mask, embeds)``), record each addition
    with the call of the layer just run (``run_layer`` applies it after that layer) and pass
    the hidden states on. Returns the function that undoes it (a no-op for other models)."""
    owners = [m for m in model.modules() if "_deepstack_process" in type(m).__dict__]
    if not owners:
        return lambda: None
    m = owners[0]
    real = m._deepstack_process

    def record(h, mask, embeds):
        i = sum(len(c) == len(calls[0]) for c in calls) - 1  # the layer whose recorder ran last
        args, kw = calls[i][-1]
        calls[i][-1] = (args, {**kw, DEEPSTACK: (real, mask, embeds)})
        return h

    m._deepstack_process = record
    return lambda: m.__dict__.pop("_deepstack_process", None)


def _make_recorder():
    import torch

    class Recorder(torch.nn.Module):
        """Stands in for decoder layer ``i`` in a recording forward: keeps its arguments, passes
        the hidden states through; the last one stops the forward."""

        def __init__(self, i, last, calls):
            super().__init__()
            self.i, self.last, self.calls = i, last, calls

        def forward(self, *args, **kwargs):
            h = args[0]
            self.calls[self.i].append((args, kwargs))
            cache = kwargs.get("past_key_values")
            if cache is not None:  # the length a real layer's update would add
                z = torch.zeros(h.shape[0], 1, h.shape[1], 1, dtype=h.dtype, device=h.device)
                cache.update(z, z, self.i)
            if self.last:
                raise _Recorded
            return h
    return Recorder


def _apply_real(module, dtype, device) -> None:
    """``module.to(dtype, device)`` for the tensors that are not on the meta device."""
    import torch

    for m in module.modules():
        for store in (m._parameters, m._buffers):
            for n, t in list(store.items()):
                if t is None or t.device.type == "meta":
                    continue
                t2 = t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
                if t2 is not t:
                    store[n] = torch.nn.Parameter(t2, requires_grad=False) if isinstance(t, torch.nn.Parameter) else t2


def _layers(model):
    """The model's decoder layers (a ModuleList) and its qualified name."""
    for path in ("model.layers", "model.language_model.layers", "transformer.h"):
        try:
            return model.get_submodule(path), path
        except AttributeError:
            continue
    raise RuntimeError(f"cannot find the decoder layers of {type(model).__name__}")


def _safetensors_files(d: Path) -> list[Path]:

    index = d / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({d / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(d.glob("*.safetensors"))
    if not files:
        raise InvalidInput(f"{d}: no safetensors weights (check reads a checkpoint's *.safetensors)")
    return files
