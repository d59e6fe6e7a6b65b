"""Human-readable renderings of a plan (rich tables). Pure formatting; no decisions here."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from . import mesh as meshmod
from .plan.make import Plan
from .plan.memory import verdict
from .plan.sharding import fmt_entry


def human(n: float) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= div:
            return f"{n / div:,.2f} {unit}"
    return f"{int(n):,} B"


def pool_line(p: Plan) -> str:
    """The KV pool in tokens, blocks and bytes per chip, and how it was chosen."""
    kv = p.kv
    return (f"KV pool: {kv['max_tokens_all_users']:,} tokens (max_tokens_all_users) = "
            f"{kv['num_blocks']:,} blocks x {kv['block_size']} = {human(kv['bytes'])} per chip, "
            f"shared by {kv['max_num_seqs']} sequences ({kv['full_length_tokens']:,} tokens at full "
            f"length); {kv['pool_why']}")


def print_vision(programs: list[dict], console: Console, unit: str = "images") -> None:
    """The vision encoder's programs (``lower.summary`` of each vision bucket); ``unit``: what a
    bucket counts (the family's vision part's ``BUCKET_UNIT``)."""
    t = Table(title=f"vision programs ({unit} per call)", title_justify="left", show_edge=False)
    for col in (unit, "rows", "ops", "collectives", "FLOPs/device", "activations", "traffic"):
        t.add_column(col, justify="right")
    for s in programs:
        t.add_row(str(s["bucket"]), str(s["rows"]), str(s["ops"]), str(s["collectives"]),
                  f"{s['flops_per_device']:.3g}", human(s["activation_bytes"]), human(s["collective_traffic_bytes"]))
    console.print(t)


def vision_cap_line(c: dict) -> str:
    """``lower.vision_cap``'s arithmetic as one statement."""
    u = c["unit"]
    return (f"images capped: {c['images_per_prompt']} image(s) of the processor's largest size need {c['need']:,} {u} "
            f"({c['largest_image']:,} each, {c['largest_image_tokens']:,} prompt tokens each; a vision program of "
            f"{c['need']:,} {u} needs {human(c['need_activation_bytes'])} of activations per chip, beside "
            f"{human(c['per_chip_total'])} of {human(c['dram'])} planned; a prefill chunk holds {c['prefill_chunk']:,} "
            f"tokens, max_model_len {c['max_model_len']:,}); the largest vision bucket holds {c['cap']:,} {u} "
            f"({human(c['cap_activation_bytes'])} of activations, an image of up to {c['cap_image_tokens']:,} tokens): "
            f"a request whose images need more than {c['cap']:,} {u} is refused (400) naming this limit")


def host_line(h) -> str:
    """Whether the emulated mesh fits this host (``kvpool.HostPlan``), one line."""
    return f"emulated mesh on this host: {h.verdict()}"


def print_plan(p: Plan, console: Console, fixes: list[str] | None = None, host=None) -> None:
    m = p.mesh
    console.print(f"[bold]{p.bundle_name}[/] ({p.family}) on [bold]{m.describe()}[/]: "
                  f"{m.num_devices} x {m.chip.label}, {m.topology}, axes rows={m.rows} cols={m.cols}")
    if m.target_shape is not None:
        origins = ", ".join(f"({r},{c})" for r, c in meshmod.submesh_origins(m.target_shape, m.shape, m.whole().hosts))
        console.print(f"replicas: {m.replicas} x {m.rows}x{m.cols} submesh = {m.total_devices} chips "
                      f"(replica origins {origins}); each replica planned below, "
                      f"per-replica max_num_seqs {p.max_num_seqs}, total concurrency "
                      f"{m.replicas} x {p.max_num_seqs} = [bold]{p.concurrency(p.max_num_seqs)}[/] sequences")
    t = Table(title="per-device shards", title_justify="left", show_edge=False)
    for col in ("tensor", "global (split@axis)", "spec", "per device", "x", "per chip"):
        t.add_column(col, justify="right" if col in ("x", "per chip") else "left")
    for tp in p.tensors:
        spec = "[" + ", ".join(fmt_entry(e) for e in tp.spec) + "]"
        dev = f"{tp.dtype}[{', '.join(map(str, tp.device_shape))}]"
        note = f" ({'; '.join(tp.notes)})" if tp.notes else ""
        t.add_row(tp.name, Text(tp.notation()), Text(spec), Text(dev + note), str(tp.count), human(tp.bytes))
    console.print(t)

    mem = p.memory
    mt = Table(title="per-chip DRAM" + (" (every chip of every replica)" if m.target_shape else ""), title_justify="left", show_edge=False)
    mt.add_column("what")
    mt.add_column("bytes", justify="right")
    mt.add_column("", justify="right")
    for dt, n in sorted(mem.weights_by_dtype.items()):
        mt.add_row(f"weights {dt}", f"{n:,}", human(n))
    kv = p.kv
    mt.add_row(f"KV cache {kv['dtype']} ({kv['num_blocks']:,} blocks x {kv['block_size']})",
               f"{mem.kv_cache:,}", human(mem.kv_cache))
    what = ("the vision encoder's largest layer" if p.vision and p.activation_buffers is not None
            and not any(n == "logits" for n, _ in p.activation_buffers) else f"{p.activation_tokens} tokens")
    mt.add_row(f"activations ({what})", f"{mem.activations:,}", human(mem.activations))
    mt.add_row(f"trace region ({p.num_traces} traces)", f"{mem.trace_region:,}", human(mem.trace_region))
    if mem.draft:
        mt.add_row(p.draft_line(), f"{mem.draft:,}", human(mem.draft))
    mt.add_row("[bold]total[/]", f"{mem.total:,}", human(mem.total))
    mt.add_row(f"chip DRAM ({m.chip.dram_banks} banks x {m.chip.dram_bank_bytes:,})", f"{mem.dram:,}",
               human(mem.dram))
    fits, word, numbers = verdict(mem, human)
    mt.add_row("[bold]verdict[/]", "", f"[{'green' if fits else 'red'}]{word}[/]: {numbers}")
    console.print(mt)
    console.print(Text(pool_line(p)))
    if host is not None:
        console.print(Text(host_line(host)))

    if p.collectives:
        ct = Table(title="collectives per forward", title_justify="left", show_edge=False)
        for col in ("layer", "op", "collective", "axis", "x", "bytes/token/device"):
            ct.add_column(col, justify="right" if col in ("x", "bytes/token/device") else "left")
        for c in p.collectives:
            ct.add_row(c.layer, Text(c.op), c.kind, f"{'*'.join(c.axes)} ({c.devices})", str(c.count),
                       f"{c.traffic_bytes_per_token:,}")
        console.print(ct)
        console.print(f"decode traffic: {p.decode_traffic_bytes_per_token:,} bytes per token per device")
    else:
        console.print("collectives: none (nothing is split across devices)")

    if not p.fits:
        console.print("[bold]largest consumers per chip:[/]")
        for name, n in p.consumers()[:4]:
            console.print(Text(f"  {name}: {human(n)}"))
        if fixes:
            console.print("[bold]suggested fixes (each checked by re-planning):[/]")
            for f in fixes:
                console.print(Text(f"  - {f}"))
