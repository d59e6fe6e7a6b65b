"""The `ttbundle` command line. Thin: parses, calls the library, prints. The only place that turns
errors into exit codes (0 ok, 1 failed, 2 invalid input, 3 does not fit; see docs/cli.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.text import Text

from . import __version__
from .errors import EXIT_DOES_NOT_FIT, EXIT_INVALID, TTBundleError

app = typer.Typer(help="Declarative model bundles for vLLM on Tenstorrent meshes.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def fail(e: TTBundleError) -> None:
    err.print(Text(f"[error] {e.message}"))
    for d in e.diagnostics:
        err.print(Text(f"  {d}"))
    raise typer.Exit(e.exit_code)


def _write_atomic(path: Path, text: str) -> None:
    from .fsutil import write_text_atomic
    write_text_atomic(path, text)


def _targets(bundle, mesh: Optional[str]) -> list[str]:
    from . import mesh as meshmod
    if mesh:
        meshmod.resolve(mesh)
        return [mesh]
    return list(bundle.spec.targets)


@app.command()
def validate(spec: Path = typer.Argument(..., help="Bundle spec (YAML)."),
             mesh: Optional[str] = typer.Option(None, "--mesh", "-m", help="Check this mesh only "
                                                "(default: every target)."),
             as_json: bool = typer.Option(False, "--json", help="Machine-readable result.")):
    """Check a spec: schema, divisibility on each mesh, buckets, dtypes, memory fit.

    Exit 0 valid, 2 invalid (every problem listed as file:line:col: key.path: message),
    3 valid but does not fit a target's memory (see `ttbundle plan`)."""
    from . import plan as planmod, spec as specmod
    try:
        bundle = specmod.load(spec)
        targets = _targets(bundle, mesh)
        diags, plans = [], {}
        for t in targets:
            try:
                plans[t] = planmod.make_plan(bundle, t)
            except TTBundleError as e:
                diags += e.diagnostics or []
        if diags:
            raise specmod.InvalidInput(f"{spec}: invalid spec", diags)
    except TTBundleError as e:
        if as_json:
            out.print_json(data={"valid": False, "errors": [d.to_json() for d in e.diagnostics]
                                 or [{"message": e.message}]})
            raise typer.Exit(e.exit_code)
        fail(e)
    no_fit = [t for t, p in plans.items() if not p.fits]
    if as_json:
        out.print_json(data={"valid": True, "fits": {t: p.fits for t, p in plans.items()},
                             "warnings": [w.to_json() for w in bundle.warnings]})
    else:
        for w in bundle.warnings:
            err.print(Text(str(w)))
        for t in no_fit:
            p = plans[t]
            err.print(Text(f"{spec}: {t}: does not fit: needs {p.memory.total:,} B per chip, "
                           f"chip has {p.memory.dram:,} B; run `ttbundle plan {spec} --mesh {t}`"))
        ok = [t for t in plans if t not in no_fit]
        if ok:
            out.print(Text(f"{spec}: valid; fits {', '.join(ok)}"))
    if no_fit:
        raise typer.Exit(EXIT_DOES_NOT_FIT)


@app.command()
def plan(spec: Path = typer.Argument(..., help="Bundle spec (YAML)."),
         mesh: Optional[str] = typer.Option(None, "--mesh", "-m", help="Mesh (default: first target)."),
         as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
         svg: Optional[Path] = typer.Option(None, "--svg", help="Also draw the plan to this SVG file.")):
    """Per-device shards, per-chip memory and collectives. Exit 0 fits, 3 does not fit."""
    from . import plan as planmod, report, spec as specmod
    try:
        bundle = specmod.load(spec)
        target = _targets(bundle, mesh)[0]
        p = planmod.make_plan(bundle, target)
        fx = [] if p.fits else planmod.fixes(bundle, p)
        if svg:
            from .svg import render_plan
            _write_atomic(svg, render_plan(p))
    except TTBundleError as e:
        fail(e)
    if as_json:
        data = p.to_json()
        data["fixes"] = fx
        out.print_json(data=data)
    else:
        report.print_plan(p, out, fx)
    if not p.fits:
        raise typer.Exit(EXIT_DOES_NOT_FIT)


@app.command()
def init(from_hf: Path = typer.Option(..., "--from-hf", help="Hugging Face model directory (config.json; "
                                      "*.safetensors and tokenizer files are referenced if present)."),
         output: Path = typer.Option(..., "-o", "--output", help="Spec file to write."),
         mesh: Optional[list[str]] = typer.Option(None, "--mesh", "-m", help="Target mesh; repeat for "
                                                  "several (default: N150)."),
         weights_dtype: str = typer.Option("bf16", "--weights-dtype", help="bf16 | bfp8 | bfp4: "
                                           "default weight dtype (the embedding stays bf16)."),
         max_model_len: Optional[int] = typer.Option(None, "--max-model-len", help="Default: "
                                                     "min(max_position_embeddings, 8192)."),
         max_num_seqs: Optional[int] = typer.Option(None, "--max-num-seqs", help="Default: 32 "
                                                    "(the largest decode bucket)."),
         name: Optional[str] = typer.Option(None, "--name", help="Bundle name (default: from the "
                                            "directory name)."),
         force: bool = typer.Option(False, "--force", help="Overwrite the spec file if it exists.")):
    """Write a commented, valid spec from a Hugging Face config.json.

    Nothing is written unless the spec validates; an existing file needs --force.

    Exit 0 written (also when a mesh does not fit: see its line), 2 invalid input."""
    from .init import init_spec
    try:
        r = init_spec(from_hf, output, mesh, weights_dtype, max_model_len, max_num_seqs, name, force)
    except TTBundleError as e:
        fail(e)
    for w in r.bundle.warnings:
        err.print(Text(str(w)))
    for note in r.notes:
        err.print(Text(f"note: {note}"))
    out.print(Text(f"wrote {r.path}"))
    for line in r.summary():
        out.print(Text(f"  {line}"))


@app.command()
def check(spec: Path = typer.Argument(..., help="Bundle spec (YAML)."),
          mesh: Optional[str] = typer.Option(None, "--mesh", "-m", help="Mesh (default: first target)."),
          steps: int = typer.Option(32, "--steps", min=1, help="Greedy decode steps to compare."),
          dtype: str = typer.Option("fp32", "--dtype", help="fp32 (tokens must be identical) or bf16 "
                                    "(PCC >= 0.99 per layer)."),
          random_weights: bool = typer.Option(False, "--random-weights", help="Use a random instance of "
                                              "the architecture instead of weights.source."),
          seed: int = typer.Option(0, "--seed"),
          prompt_len: Optional[int] = typer.Option(None, "--prompt-len", help="Prompt tokens (default: "
                                                   "a bit over one prefill chunk)."),
          device: str = typer.Option("cpu", "--device", help="torch device for both sides (cpu, cuda)."),
          as_json: bool = typer.Option(False, "--json", help="Print the report as JSON.")):
    """Run the emulated mesh and Hugging Face transformers on the same weights and tokens.

    Exit 0 when they agree (fp32: identical greedy tokens; bf16: PCC >= 0.99 per layer),
    1 otherwise, naming the first diverging layer."""
    from . import plan as planmod, spec as specmod
    from .check import run_check
    try:
        bundle = specmod.load(spec)
        target = _targets(bundle, mesh)[0]
        report = run_check(bundle, target, steps=steps, dtype=dtype, random_weights=random_weights,
                           seed=seed, prompt_len=prompt_len, device=device)
    except TTBundleError as e:
        fail(e)
    if as_json:
        out.print_json(data=report.to_json())
    else:
        from rich.table import Table
        t = Table(title=f"{report.bundle} on {report.mesh} vs transformers ({report.dtype}, prompt "
                  f"{report.prompt_len} tokens, {report.steps} steps)", title_justify="left", show_edge=False)
        for c in ("layer", "prefill max|err|", "prefill PCC", "worst decode max|err|", "worst decode PCC"):
            t.add_column(c, justify="right")
        layers = sorted({s.layer for s in report.layers})
        for li in layers:
            pre = next(s for s in report.layers if s.layer == li and s.step == "prefill")
            dec = [s for s in report.layers if s.layer == li and s.step != "prefill"]
            w = min(dec, key=lambda s: s.pcc) if dec else None
            t.add_row(str(li), f"{pre.max_abs:.3g}", f"{pre.pcc:.6f}",
                      f"{w.max_abs:.3g}" if w else "-", f"{w.pcc:.6f}" if w else "-")
        out.print(t)
        agree = sum(a == b for a, b in zip(report.ref_tokens, report.emu_tokens))
        out.print(f"greedy tokens: {agree}/{len(report.ref_tokens)} identical")
        if report.passed:
            out.print("[green]check passed[/]")
        else:
            d = report.diverging()
            where = f"; first diverging: layer {d.layer} at {d.step} (PCC {d.pcc:.6f}, max|err| {d.max_abs:.3g})" if d else ""
            ftd = report.first_token_divergence
            err.print(Text(f"[error] check failed: "
                           + (f"tokens diverge at step {ftd}" if ftd is not None else "PCC below 0.99")
                           + where))
    if not report.passed:
        raise typer.Exit(1)


@app.command()
def schema(output: Optional[Path] = typer.Option(None, "-o", "--output", help="Write here instead of stdout.")):
    """The bundle spec's JSON Schema (for editor completion: `# yaml-language-server: $schema=...`)."""
    from .spec import json_schema
    text = json.dumps(json_schema(), indent=2) + "\n"
    if output:
        try:
            _write_atomic(output, text)
        except TTBundleError as e:
            fail(e)
    else:
        sys.stdout.write(text)


@app.command()
def meshes(as_json: bool = typer.Option(False, "--json")):
    """Mesh presets (MESH_DEVICE names) with chip facts."""
    from rich.table import Table
    from .mesh import PRESETS
    rows = [{"name": m.name, "shape": list(m.shape), "devices": m.num_devices, "arch": m.chip.arch,
             "dram_bytes_per_chip": m.chip.dram_bytes, "l1_bytes_per_chip": m.chip.l1_bytes,
             "topology": m.topology, "hosts": m.hosts, "note": m.note} for m in PRESETS.values()]
    if as_json:
        out.print_json(data=rows)
        return
    t = Table(show_edge=False)
    for c in ("name", "shape", "chips", "arch", "DRAM/chip", "L1/chip", "topology", "note"):
        t.add_column(c)
    for r in rows:
        t.add_row(r["name"], f"{r['shape'][0]}x{r['shape'][1]}", str(r["devices"]), r["arch"],
                  f"{r['dram_bytes_per_chip']:,}", f"{r['l1_bytes_per_chip']:,}", r["topology"], r["note"])
    out.print(t)


@app.command()
def version():
    """Print ttbundle's version."""
    out.print(f"ttbundle {__version__}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
