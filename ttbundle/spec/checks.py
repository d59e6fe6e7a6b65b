"""The spec's semantic rules that need no mesh (``plan.make.check_mesh`` adds the per-target ones)."""

from __future__ import annotations

from .. import mesh as meshmod
from ..errors import Diagnostic, InvalidInput
from ..tiles import TILE, round_up
from .bundle import Bundle
from .schema import DECODE_TRACE_SIZES
from .. import embed, speculative
from ..hub import NotCached


def check(b: Bundle, load=None) -> list[Diagnostic]:
    """Every mesh-independent rule; ``plan.make.check_mesh`` adds the per-target ones."""
    s, a, d = b.spec, b.arch, []
    names = {t.name: t for t in b.family.tensors(a)}

    for i, t in enumerate(s.targets):
        if meshmod.try_resolve(t) is None:
            d.append(b.locate(("targets", i), f"unknown mesh {t!r}; valid: {meshmod.valid_names()}"))
    if len(set(s.targets)) != len(s.targets):
        d.append(b.locate(("targets",), "targets are listed twice"))

    for tgt, rep in s.replicas.items():
        at = ("replicas", tgt)
        if tgt not in s.targets:
            d.append(b.locate(at, f"{tgt!r} is not one of targets ({', '.join(s.targets)})"))
            continue
        target = meshmod.try_resolve(tgt)
        if target is None:
            continue  # reported at targets
        try:
            sub = meshmod.split(target, rep.submesh)
        except InvalidInput as e:
            d.append(b.locate(at + ("submesh",), e.message))
            continue
        if rep.count is not None and rep.count != sub.replicas:
            d.append(b.locate(at + ("count",), f"count={rep.count}, but {target.describe()} "
                              f"({target.num_devices} chips) holds {target.num_devices} / "
                              f"{sub.num_devices} = {sub.replicas} replicas of {list(rep.submesh)}; "
                              f"write count: {sub.replicas} or leave it out"))

    # sharding: names, ranks, axes
    def check_plan(plan: dict, at: tuple):
        for tname, spec in plan.items():
            if tname not in names:
                d.append(b.locate(at + (tname,), f"unknown tensor {tname!r} for family "
                                  f"{a.family}; tensors: {', '.join(names)}"))
                continue
            rank = len(names[tname].dims)
            if len(spec) != rank:
                dims = ", ".join(f"{x.name}" for x in names[tname].dims)
                d.append(b.locate(at + (tname,), f"has {len(spec)} entries but {tname} has {rank} "
                                  f"dims [{dims}]; give one entry per dim"))
            used = []
            for e in spec:
                used += e if isinstance(e, list) else ([e] if e else [])
            if len(used) != len(set(used)):
                d.append(b.locate(at + (tname,), "uses a mesh axis on two dims; an axis can split "
                                  "one dim of a tensor"))
    check_plan(s.sharding.plan, ("sharding", "plan"))
    for tgt, plan in s.sharding.targets.items():
        if tgt not in s.targets:
            d.append(b.locate(("sharding", "targets", tgt), f"{tgt!r} is not one of targets "
                              f"({', '.join(s.targets)})"))
        check_plan(plan, ("sharding", "targets", tgt))

    # dtypes that ttnn cannot represent
    pol = s.weights.dtypes
    for tname in pol.tensors:
        if tname not in names:
            d.append(b.locate(("weights", "dtypes", "tensors", tname), f"unknown tensor {tname!r}; "
                              f"tensors: {', '.join(names)}"))
    for t in names.values():
        dt = pol.dtype_of(t.name, t.group)
        if dt == "bf16" or t.kind == "matrix":
            continue
        where = (("weights", "dtypes", "tensors", t.name) if t.name in pol.tensors else
                 ("weights", "dtypes", t.group) if getattr(pol, t.group, None) else
                 ("weights", "dtypes", "default"))
        if getattr(pol, t.group, None) is None and t.name not in pol.tensors:
            continue  # 1-D tensors and the embedding silently stay bf16 under a block-float default
        reason = ("block floats need TILE layout and ttnn's embedding reads a ROW_MAJOR table"
                  if t.kind == "embedding" else "block floats need 32x32 tiles; 1-D tensors are kept ROW_MAJOR")
        d.append(b.locate(where, f"{t.name} cannot be {dt}: {reason}; use bf16"))

    # buckets
    bk = b.buckets
    bpath = ("buckets",)
    for key in ("prefill", "decode") if s.task != "embed" else ("prefill",):
        vals = getattr(bk, key)
        if not vals:
            d.append(b.locate(bpath + (key,), "needs at least one bucket"))
            continue
        if vals != sorted(vals) or len(set(vals)) != len(vals):
            d.append(b.locate(bpath + (key,), f"must be sorted and unique, got {vals}; "
                              f"write {sorted(set(vals))}"))
        for i, v in enumerate(vals):
            if v <= 0:
                d.append(b.locate(bpath + (key, i), f"{v} must be positive"))
            elif key == "prefill" and v % TILE:
                d.append(b.locate(bpath + (key, i), f"prefill bucket {v} is not a multiple of {TILE} "
                                  f"(tile height); use {round_up(v, TILE)}"))
            elif key == "decode" and v not in DECODE_TRACE_SIZES:
                d.append(b.locate(bpath + (key, i), f"decode batch {v} is not a traceable size; "
                                  f"use one of {', '.join(map(str, DECODE_TRACE_SIZES))}"))
    rt = s.runtime
    if bk.decode and rt.max_num_seqs > max(bk.decode):
        more = ("" if s.replicas else "; or split a target into replicas (`replicas:`), "
                "each decoding max_num_seqs")
        d.append(b.locate(("runtime", "max_num_seqs"), f"max_num_seqs={rt.max_num_seqs} exceeds the "
                          f"largest decode bucket {max(bk.decode)}; lower it or add a bucket "
                          f"(max {max(DECODE_TRACE_SIZES)}){more}"))
    if bk.prefill:
        top = max(bk.prefill)
        if bk.prefill_chunk is not None:
            if bk.prefill_chunk not in bk.prefill:
                d.append(b.locate(bpath + ("prefill_chunk",), f"prefill_chunk={bk.prefill_chunk} "
                                  f"must be one of the prefill buckets {bk.prefill} (a chunk runs a "
                                  "traced prefill shape)"))
            elif bk.prefill_chunk % rt.kv_block_size:
                d.append(b.locate(bpath + ("prefill_chunk",), f"prefill_chunk={bk.prefill_chunk} "
                                  f"is not a multiple of runtime.kv_block_size={rt.kv_block_size}"))
        elif rt.max_model_len > top:
            d.append(b.locate(bpath + ("prefill",), f"prompts up to max_model_len={rt.max_model_len} "
                              f"need a prefill bucket >= {rt.max_model_len} (largest is {top}) or "
                              f"buckets.prefill_chunk (e.g. {top})"))
    # runtime
    if rt.kv_block_size % TILE:
        d.append(b.locate(("runtime", "kv_block_size"), f"kv_block_size={rt.kv_block_size} is not a "
                          f"multiple of {TILE}"))
    pool = rt.max_tokens_all_users
    if isinstance(pool, int) and pool < rt.max_model_len:
        d.append(b.locate(("runtime", "max_tokens_all_users"), f"max_tokens_all_users={pool} is "
                          f"below max_model_len={rt.max_model_len}: the KV pool must hold one "
                          f"full-length sequence; set it to at least {rt.max_model_len}, lower "
                          "max_model_len, or write `auto` (the largest pool that fits)"))
    if rt.max_model_len > a.max_position_embeddings:
        d.append(b.locate(("runtime", "max_model_len"), f"max_model_len={rt.max_model_len} exceeds the "
                          f"model's max_position_embeddings={a.max_position_embeddings}"))
    if rt.output_tokens_per_step > 1 and rt.sample_on_device_mode == "off":
        d.append(b.locate(("runtime", "output_tokens_per_step"), f"output_tokens_per_step="
                          f"{rt.output_tokens_per_step} feeds each sampled token into the next decode "
                          "on the device, but sample_on_device_mode is off; set output_tokens_per_step: 1 "
                          "or sample on the device"))
    if rt.output_tokens_per_step > 1 and s.speculative is not None:
        d.append(b.locate(("runtime", "output_tokens_per_step"), f"output_tokens_per_step="
                          f"{rt.output_tokens_per_step} and speculative: both schedule several tokens "
                          "a decode step; keep one (output_tokens_per_step: 1, or no speculative:)"))
    # architecture consistency
    if a.num_attention_heads % a.kv_heads:
        d.append(b.locate(("model", "num_key_value_heads"), f"num_attention_heads={a.num_attention_heads}"
                          f" is not a multiple of num_key_value_heads={a.kv_heads}"))
    if a.head_dim is None and a.hidden_size % a.num_attention_heads:
        d.append(b.locate(("model", "hidden_size"), f"hidden_size={a.hidden_size} is not divisible by "
                          f"num_attention_heads={a.num_attention_heads}; set head_dim"))
    # paths
    for key, p in (("weights.source", s.weights.source), ("tokenizer", s.tokenizer)):
        if p is None or p is False:
            continue
        at, path = tuple(key.split(".")), b.base_dir / p
        try:
            path = b.resolve_path(p, download=False)  # validation never downloads a model id
            found = path.exists()
        except NotCached as e:  # a model id not downloaded yet: an error only when nothing will
            d.append(b.locate(at, e.message, "error" if e.final else "warning"))
            continue
        except InvalidInput as e:
            d.append(b.locate(at, e.message))
            continue
        except OSError as e:  # ENAMETOOLONG, ELOOP, ...
            d.append(b.locate(at, f"{path}: {e.strerror or e}; give a directory path that exists"))
            continue
        if not found:
            d.append(b.locate(at, f"{path} does not exist (a directory, relative to the spec, or a "
                              "model id ORG/NAME[@REVISION] in the Hugging Face cache)"))
    d += b.family.check(a, b)
    d += _check_vision(b)
    d += embed.check(b)
    d += speculative.check(b, load)  # load: spec.load.load, for a draft's spec (passed in: no cycle)
    return d


def _check_vision(b: Bundle) -> list[Diagnostic]:
    """Image settings against the model's vision part and the token budget."""
    s, v = b.spec, getattr(b.arch, "vision", None)
    if v is None:
        if s.vision is not None:
            return [b.locate(("vision",), f"the model has no vision part ({b.arch.family} "
                             "text only); remove `vision:` or import a multimodal config")]
        return []
    d, vs, at = [], b.vision, ("vision",)
    bks = vs.buckets
    if not bks:
        return [b.locate(at + ("buckets",), "needs at least one entry")]
    if bks != sorted(set(bks)):
        d.append(b.locate(at + ("buckets",), f"must be sorted and unique, got {bks}; write {sorted(set(bks))}"))
    for i, n in enumerate(bks):
        if n <= 0:
            d.append(b.locate(at + ("buckets", i), f"{n} must be positive"))
    # what the buckets count, and what else must fit, is the family's vision part's rule
    return d + b.family.vision_part(b.arch).check_settings(b, vs)
