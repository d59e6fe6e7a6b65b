"""The `ttbundle` command line. Thin: parses, calls the library, prints. The only place that turns
errors into exit codes (0 ok, 1 failed, 2 invalid input, 3 does not fit; see docs/cli.md)."""

from __future__ import annotations

import errno
import json
import shlex
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.text import Text

from . import __version__, hub
from .errors import EXIT_DOES_NOT_FIT, InvalidInput, TTBundleError
from .fsutil import read_user_text, write_text_atomic
from .mesh import PRESETS
from .progress import ConsoleProgress, print_results

class _Group(typer.core.TyperGroup):
    """The command group: a path the file system refuses for its length is the user's input,
    whichever command met it (`init -o`, `check`, `register --dir`, ...): one line, exit 2."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except OSError as e:
            if e.errno != errno.ENAMETOOLONG:
                raise
            fail(InvalidInput(_too_long(e.filename)))


def _too_long(name) -> str:
    name = str(name) if name is not None else ""
    parts = [p for p in name.split("/") if len(p.encode(errors="surrogateescape")) > 255]
    shown = (name[:60] + f"... ({len(name)} characters)") if len(name) > 80 else name
    if parts:
        return (f"{shown}: file name too long: a path component of {len(parts[0].encode(errors='surrogateescape'))} "
                "bytes (at most 255); shorten it")
    return f"{shown}: file name too long (a path is at most 4095 bytes); shorten it"


app = typer.Typer(help="Declarative model bundles for vLLM on Tenstorrent meshes.", cls=_Group,
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def fail(e: TTBundleError) -> None:
    err.print(Text(f"[error] {e.message}"))
    for d in e.diagnostics:
        err.print(Text(f"  {d}"))
    raise typer.Exit(e.exit_code)


def _write_atomic(path: Path, text: str) -> None:
    write_text_atomic(path, text)


@app.command()
def validate(spec: Path = typer.Argument(..., help="Bundle spec (YAML)."),
             mesh: Optional[str] = typer.Option(None, "--mesh", "-m", help="Check this mesh only "
                                                "(default: every target)."),
             as_json: bool = typer.Option(False, "--json", help="Machine-readable result.")):
    """Check a spec: schema, divisibility on each mesh, buckets, dtypes, memory fit.

    Exit 0 valid, 2 invalid (every problem listed as file:line:col: key.path: message),
    3 valid but does not fit a target's memory (see `ttbundle plan`)."""
    from .plan.host import host_plan
    from .plan.validate import does_not_fit, plan_targets
    try:
        bundle, plans = plan_targets(spec, mesh)
    except TTBundleError as e:
        if as_json:
            out.print_json(data={"valid": False, "errors": [d.to_json() for d in e.diagnostics]
                                 or [{"message": e.message}]})
            raise typer.Exit(e.exit_code)
        fail(e)
    no_fit = [t for t, p in plans.items() if not p.fits]
    hosts = {t: host_plan(bundle, p) for t, p in plans.items()}
    if as_json:
        out.print_json(data={"valid": True, "fits": {t: p.fits for t, p in plans.items()},
                             "emulated_host": {t: h.to_json() for t, h in hosts.items()},
                             "warnings": [w.to_json() for w in bundle.warnings]})
    else:
        for w in bundle.warnings:
            err.print(Text(str(w)))
        for t in no_fit:
            for line in does_not_fit(spec, t, plans[t], bundle):
                err.print(Text(line))
        ok = [t for t in plans if t not in no_fit]
        if ok:
            out.print(Text(f"{spec}: valid; fits {', '.join(ok)}"))
        for t, h in ((t, hosts[t]) for t in ok):  # a target that fits: whether its emulated mesh fits here
            out.print(Text(f"  {t}, emulated on this host: {h.verdict()}"))
    if no_fit:
        raise typer.Exit(EXIT_DOES_NOT_FIT)


@app.command()
def plan(spec: Path = typer.Argument(..., help="Bundle spec (YAML)."),
         mesh: Optional[str] = typer.Option(None, "--mesh", "-m", help="Mesh (default: first target)."),
         as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
         svg: Optional[Path] = typer.Option(None, "--svg", help="Also draw the plan to this SVG file.")):
    """Per-device shards, per-chip memory and collectives. Exit 0 fits, 3 does not fit."""
    from . import report, spec as specmod
    from .plan.advice import fixes
    from .plan.host import host_plan
    from .plan.make import make_plan
    from .plan.validate import targets
    try:
        bundle = specmod.load(spec)
        target = targets(bundle, mesh)[0]
        p = make_plan(bundle, target)
        host = host_plan(bundle, p)
        fx = [] if p.fits else fixes(bundle, p)
        from .lower import vision_cap, vision_summaries
        vision = vision_summaries(bundle, p)
        cap = vision_cap(bundle, p)
        if svg:
            from .svg import render_plan
            _write_atomic(svg, render_plan(p))
    except TTBundleError as e:
        fail(e)
    if as_json:
        data = p.to_json()
        data["fixes"] = fx
        data["emulated_host"] = host.to_json()
        if vision:
            data["vision_programs"] = vision
        if cap:
            data["vision_cap"] = cap
        out.print_json(data=data)
    else:
        report.print_plan(p, out, fx, host)
        if vision:
            report.print_vision(vision, out, bundle.family.vision_part(bundle.arch).BUCKET_UNIT)
        if cap:
            out.print(Text(report.vision_cap_line(cap)))
    if not p.fits:
        raise typer.Exit(EXIT_DOES_NOT_FIT)


@app.command()
def init(from_hf: str = typer.Option(..., "--from-hf", help="Hugging Face model directory (config.json; "
                                     "*.safetensors and tokenizer files are referenced if present), "
                                     "a hub-cache snapshot, or a model id ORG/NAME[@REVISION] "
                                     "(from the Hugging Face cache; downloaded unless HF_HUB_OFFLINE=1)."),
         output: Path = typer.Option(..., "-o", "--output", help="Spec file to write."),
         mesh: Optional[list[str]] = typer.Option(None, "--mesh", "-m", help="Target mesh; repeat for "
                                                  "several (default: N150)."),
         weights_dtype: Optional[str] = typer.Option(None, "--weights-dtype", help="bf16 | bfp8 | bfp4: "
                                                     "default weight dtype (the embedding stays bf16); "
                                                     "default: bf16, or bfp8 / bfp4 MLP where bf16 "
                                                     "does not fit."),
         max_model_len: Optional[int] = typer.Option(None, "--max-model-len", help="Default: "
                                                     "min(max_position_embeddings, 8192)."),
         max_num_seqs: Optional[int] = typer.Option(None, "--max-num-seqs", help="Default: 32 "
                                                    "(the largest decode bucket)."),
         name: Optional[str] = typer.Option(None, "--name", help="Bundle name (default: from the "
                                            "model's name: the directory's, or NAME of a model id "
                                            "or hub-cache snapshot)."),
         force: bool = typer.Option(False, "--force", help="Overwrite the spec file if it exists."),
         hf_model: Optional[str] = typer.Option(None, "--hf-model", help="The model's Hugging Face id "
                                                "(ORG/NAME) for the spec's hf_model (default: from a "
                                                "hub-cache path or config.json's _name_or_path)."),
         task: Optional[str] = typer.Option(None, "--task", help="generate | embed: an embedding bundle "
                                            "(task: embed, served at /v1/embeddings); default: embed for a "
                                            "sentence-transformers checkpoint (modules.json with a Pooling "
                                            "module), else generate.")):
    """Write a commented, valid spec from a Hugging Face config.json.

    Nothing is written unless the spec validates and fits every mesh (the weight dtype and the
    KV pool are chosen to fit); an existing file needs --force.

    Exit 0 written, 2 invalid input, 3 does not fit a mesh (the arithmetic and fixes listed)."""
    from .init import init_spec
    try:
        r = init_spec(from_hf, output, mesh, weights_dtype, max_model_len, max_num_seqs, name, force, hf_model,
                      task)
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
def check(target: Path = typer.Argument(..., help="A bundle spec (YAML), or a built package directory."),
          mesh: Optional[str] = typer.Option(None, "--mesh", "-m", help="Mesh (spec only; default: first target)."),
          steps: int = typer.Option(32, "--steps", min=1, help="Decode steps to compare (fed the "
                                    "prompt's tokens again: teacher forcing)."),
          dtype: str = typer.Option("fp32", "--dtype", help="Compute dtype of both sides: fp32 or bf16."),
          random_weights: bool = typer.Option(False, "--random-weights", help="Spec only: build from a "
                                              "random instance of the architecture instead of weights.source."),
          reference: Optional[str] = typer.Option(None, "--reference", help="Package only: the HF checkpoint "
                                                  "to compare with, a directory or a model id ORG/NAME[@REVISION] "
                                                  "(default: the one it was built from)."),
          seed: int = typer.Option(0, "--seed"),
          prompt_len: Optional[int] = typer.Option(None, "--prompt-len", help="Prompt tokens, run in the "
                                                   "package's own prefill chunks (default: a bit over one chunk of at "
                                                   "most 1024 tokens; docs/check.md)."),
          device: str = typer.Option("cpu", "--device", help="torch device for both sides (cpu, cuda)."),
          image: Optional[list[Path]] = typer.Option(None, "--image", help="An image file in the prompt "
                                                     "(multimodal models; repeatable, at most "
                                                     "vision.images_per_prompt)."),
          text_file: Optional[Path] = typer.Option(None, "--text", help="A UTF-8 text file to read "
                                                   "(default: the public-domain text shipped with ttbundle)."),
          record: bool = typer.Option(True, "--record/--no-record", help="Package only: keep the result in "
                                      "the package as checks/<dtype>.json (bound to its manifest; no hash "
                                      "changes), for `ttbundle ls` and `serve --require-checked`."),
          as_json: bool = typer.Option(False, "--json", help="Print the report as JSON.")):
    """Two verdicts, one decoder layer in memory at a time. Executor: the package's programs on
    its own weights (emulated mesh) against transformers on the checkpoint stored as the
    package declares it, stage by stage on the same input (a bug, at any storage and depth).
    Quality: the package's next-token distributions against the original checkpoint's on
    natural text (top-1, top-5, KL divergence, perplexity ratio) against the spec's targets. A
    spec is built into a temporary package first.

    Exit 0 when both pass, 1 when either fails (the message says which, and the first wrong
    stage and step or the missed metric), 2 for bad input."""
    from . import spec as specmod
    from .check import check_package, recorded_checkpoint, run_check
    from .runtime.packages import is_package
    try:
        text = None
        if text_file is not None:
            text = read_user_text(text_file, "text file (--text)")
        if is_package(target):
            if mesh is not None or random_weights:
                raise InvalidInput(f"{target}: a package is checked as built; --mesh and --random-weights "
                                   "apply to a spec")
            ref = hub.resolve(reference).path if reference is not None else recorded_checkpoint(target)
            report = check_package(target, ref, steps=steps, dtype=dtype, seed=seed, prompt_len=prompt_len,
                                   device=device, images=image or None, text=text)
            if record:
                from .check.record import make_record, write_record
                try:
                    where = write_record(target, make_record(report, target, ref))
                    err.print(Text(f"check record: {where}"))
                except OSError as e:
                    err.print(Text(f"[warning] check record not written ({e.strerror or e}); --no-record skips it"))
        else:
            if reference is not None:
                raise InvalidInput("--reference applies to a package directory; a spec's reference is "
                                   "its weights.source")
            from .plan.validate import targets
            bundle = specmod.load(target)
            name = targets(bundle, mesh)[0]
            report = run_check(bundle, name, steps=steps, dtype=dtype, random_weights=random_weights,
                               seed=seed, prompt_len=prompt_len, device=device, images=image or None, text=text)
    except TTBundleError as e:
        fail(e)
    if as_json:
        out.print_json(data=report.to_json())
    else:
        _print_check(report)
    if not report.passed:
        raise typer.Exit(1)


def _print_check(report) -> None:
    """The human-readable form of a check's two verdicts (docs/check.md)."""
    from rich.table import Table
    ex, q = report.executor, report.quality
    t = Table(title=f"{report.bundle} on {report.mesh}: the emulated mesh vs the expected run ({report.dtype}, "
              f"prompt {report.prompt_len} tokens in chunks of {report.prefill_chunk}, {report.steps} steps; normalised error, bound {ex.bound:g})",
              title_justify="left", show_edge=False)
    for c in ("stage", "prefill error", "worst decode error", "PCC vs original (prefill)"):
        t.add_column(c, justify="right")
    drift = {(d["step"], d["layer"]): d["pcc"] for d in report.drift}
    text = [s for s in ex.stages if s.step != "image"]
    for key in dict.fromkeys((s.stage, s.layer) for s in text):
        pre = next((s for s in text if (s.stage, s.layer) == key and s.step == "prefill"), None)
        dec = [s for s in text if (s.stage, s.layer) == key and s.step != "prefill"]
        w = max(dec, key=lambda s: s.err) if dec else None
        name = str(key[1]) if key[0] == "layer" else key[0]
        d = drift.get(("prefill", key[1])) if key[0] == "layer" else None
        t.add_row(name, f"{pre.err:.3g}" if pre else "-", f"{w.err:.3g}" if w else "-",
                  f"{d:.6f}" if d is not None else "-")
    out.print(t)
    for s in ex.stages:
        if s.step == "image":
            out.print(f"image soft tokens (vision program vs the expected run): normalised error {s.err:.3g}")
    dec = ex.decisive
    agree = sum(ex.exp_tokens[p] == ex.emu_tokens[p] for p in dec)
    out.print(f"executor: {agree}/{len(dec)} decisive next-token predictions identical to the expected run's "
              f"({len(ex.margins)} compared); " + ("[green]passed[/]" if ex.passed else "[red]failed[/]"))
    if ex.routing:
        r = ex.routing
        out.print(f"expert choices: {r['choices'] - r['flipped']}/{r['choices']} identical on the same input")
    st = report.storage
    out.print(f"storage: weights {', '.join(f'{k} x{v}' for k, v in sorted(st['weights'].items()))}; "
              f"KV cache {st['kv_cache']} ({report.kv_blocks} blocks allocated)")
    judged = "" if q.judged else " (not judged: " + q.text + ")"
    out.print(f"quality vs the original checkpoint on {q.text}{judged}: top-1 {q.top1:.3f}, top-5 {q.top5:.3f}, "
              f"KL mean {q.kl_mean:.4g} p99 {q.kl_p99:.4g} p99.9 {q.kl_p999:.4g}, perplexity {q.ppl_package:.4g} "
              f"vs {q.ppl_original:.4g} (ratio {q.ppl_ratio:.4f}); targets ({q.storage}): "
              + ", ".join(f"{k} {v:g}" for k, v in q.targets.items()))
    if report.passed:
        out.print("[green]check passed[/]")
    else:
        err.print(Text(f"[error] check failed: {report.failure()}"))


@app.command()
def build(spec: Path = typer.Argument(..., help="Bundle spec (YAML) with weights.source."),
          mesh: Optional[str] = typer.Option(None, "--mesh", "-m", help="Build for this mesh only "
                                             "(default: every target)."),
          output: Path = typer.Option(Path("packages"), "-o", "--output", help="Output directory; "
                                      "packages go to OUT/<mesh>/<bundle> (EXTRA_MODELS_DIR=OUT/<mesh>)."),
          dry_run: bool = typer.Option(False, "--dry-run", help="List the trace set with estimated sizes "
                                       "and time, the content key and what would be rebuilt; write nothing."),
          as_json: bool = typer.Option(False, "--json", help="JSON progress events, one per line (CI)."),
          force: bool = typer.Option(False, "--force", help="Rebuild every artifact, reusing nothing."),
          no_warmup: bool = typer.Option(False, "--no-warmup", help="Skip running each new trace once on "
                                         "the emulated backend (recorded as not warmed)."),
          backend: str = typer.Option("emulated", "--backend", help="emulated, or ttnn: also write "
                                      "per-device .tensorbin weight caches (tensorbin/) for Tenstorrent hosts.")):
    """Convert the checkpoint, lower every trace and write a registrable package per mesh.

    Unchanged packages are left alone (content key); a changed bucket rebuilds only its program.
    Exit 0 built or up to date, 1 failed, 2 invalid input, 3 does not fit."""
    from . import spec as specmod
    from .build import build as run_build
    from .plan.validate import targets
    results = []
    try:
        bundle = specmod.load(spec)
        for t in targets(bundle, mesh):
            if as_json:
                def emit(e, _t=t):
                    sys.stdout.write(json.dumps({"mesh": _t, **e}) + "\n")
                    sys.stdout.flush()
            else:
                emit = ConsoleProgress(err, prefix=f"{t}: ")
            results.append(run_build(bundle, t, output, dry_run=dry_run, force=force,
                                     warmup=not no_warmup, progress=emit, backend=backend))
    except TTBundleError as e:
        if as_json:
            sys.stdout.write(json.dumps({"event": "error", "message": e.message,
                                         "diagnostics": [d.to_json() for d in e.diagnostics]}) + "\n")
            raise typer.Exit(e.exit_code)
        fail(e)
    if not as_json:
        print_results(results, out)


@app.command()
def buckets(spec: Path = typer.Argument(..., help="Bundle spec (YAML)."),
            lengths: Path = typer.Option(..., "--lengths", help="Request-length histogram: CSV "
                                         "(length[,count]) or JSONL ({\"length\": n, \"count\": c})."),
            max_traces: Optional[int] = typer.Option(None, "--max-traces", "-k", min=1, help="Prefill "
                                                     "buckets in the proposed ladder (default: as many as now)."),
            svg: Optional[Path] = typer.Option(None, "--svg", help="Plot the histogram, both ladders' "
                                               "edges and their padding to this SVG file."),
            as_json: bool = typer.Option(False, "--json", help="Print the analysis as JSON.")):
    """Padding waste of the prefill buckets on real request lengths, and the ladder of at most K
    buckets that minimizes expected padded tokens (exact)."""
    from . import buckets as bk, spec as specmod
    try:
        bundle = specmod.load(spec)
        report = bk.analyze(bundle, bk.read_lengths(lengths), max_traces)
        if svg:
            _write_atomic(svg, bk.render_svg(report, f"{bundle.spec.name}: {lengths.name}"))
    except TTBundleError as e:
        fail(e)
    if as_json:
        out.print_json(data=report.to_json())
    else:
        bk.print_report(report, out)


cache_app = typer.Typer(help="Package content keys and integrity.", no_args_is_help=True)
app.add_typer(cache_app, name="cache")


@cache_app.command("explain")
def cache_explain(package: Path = typer.Argument(..., help="A package directory (OUT/<mesh>/<bundle>)."),
                  spec: Optional[Path] = typer.Option(None, "--spec", help="Spec to compare with "
                                                      "(default: the one the package was built from)."),
                  as_json: bool = typer.Option(False, "--json")):
    """Which key fields changed since the package was built, and what a build would redo.

    Exit 0 up to date, 1 a rebuild is due."""
    from rich.table import Table
    from .build import explain
    try:
        r = explain(package, spec)
    except TTBundleError as e:
        fail(e)
    if as_json:
        out.print_json(data=r)
    else:
        t = Table(title=f"{r['package']} vs {r['spec_file']}", title_justify="left", show_edge=False)
        for c in ("field", "recorded", "current", ""):
            t.add_column(c)
        for f in r["fields"]:
            short = lambda v: "-" if v is None else (str(v)[:16] if len(str(v)) == 64 else str(v))  # noqa: E731
            t.add_row(f["field"], short(f["recorded"]), short(f["current"]), "CHANGED" if f["changed"] else "")
        out.print(t)
        if r["up_to_date"]:
            out.print("up to date: `ttbundle build` would do nothing")
        else:
            changed = [f["field"] for f in r["fields"] if f["changed"]]
            out.print(f"changed since the build: {', '.join(changed) or 'nothing'}")
            if not r["warmed"]:
                out.print("built --no-warmup: `ttbundle build` runs the warm-up (`--no-warmup` would do nothing)")
            out.print(f"a build would redo: {', '.join(r['would_rebuild']) or 'only the small files'}")
        lb = r["last_build"]
        out.print(f"last build ({lb['finished']}): rebuilt {', '.join(lb['rebuilt']) or 'nothing'}; "
                  f"fields changed then: {', '.join(lb['changed_fields']) or 'none'}")
    if not r["up_to_date"]:
        raise typer.Exit(1)


@cache_app.command("verify")
def cache_verify(package: Path = typer.Argument(..., help="A package directory."),
                 hashes_only: bool = typer.Option(False, "--hashes-only",
                                                  help="Only the sha256 of every file; run no program.")):
    """Check every file of a package against the sha256 in its manifest, then run each program on
    its fixed warm-up input (emulated, float32) and compare with the reference the build recorded.
    Exit 1 names the first bad file, or the program, row and expected vs got values."""
    from . import warmref, warmup
    from .package.verify import verify_package
    try:
        m = verify_package(package)
        out.print(f"{package}: {len(m['files'])} files verified")
        if hashes_only:
            return
        res = warmup.verify_package(package, log=out.print)["float32"]
    except TTBundleError as e:
        fail(e)
    missing = warmref.unchecked(m)
    if missing:
        out.print(f"not checked (built with --no-warmup, no reference): {', '.join(missing)}")
    out.print(f"{package}: {len(res)} programs match their warm-up references")


@app.command()
def register(directory: Path = typer.Option(..., "--dir", help="A directory of packages (e.g. `ttbundle "
                                            "build`'s output, or OUT/<mesh>), or one package.")):
    """Verify every package in DIR and record DIR in the user registry (XDG config dir).

    Prints each package registered and each refused with the reason (the file that does not
    verify). Exit 0 if any package registered, 1 if none did, 2 invalid input."""
    from .runtime.registry import register_dir, registry_file
    try:
        good, bad = register_dir(directory)
    except TTBundleError as e:
        fail(e)
    for e in good:
        out.print(Text(f"registered {e.name}-{e.mesh} ({e.arch}) {e.path}"))
    for path, why in bad:
        err.print(Text(f"refused {path}: {why}"))
    if not good:
        err.print(Text(f"[error] nothing registered from {directory}"))
        raise typer.Exit(1)
    out.print(Text(f"{directory.resolve()} recorded in {registry_file()}"))


@app.command("ls")
def ls_(as_json: bool = typer.Option(False, "--json", help="Machine-readable list.")):
    """Registered packages (registered directories and EXTRA_MODELS_DIR): name, mesh, buckets."""
    from .check.record import records as check_records, summary
    from .runtime.registry import scan
    try:
        good, bad = scan(check_hashes=False)
    except TTBundleError as e:
        fail(e)
    if as_json:  # the text rich's print_json writes, without its 0.3 ms per package
        sys.stdout.write(json.dumps({"packages": [{"name": e.name, "mesh": e.mesh, "arch": e.arch,
                                                   "path": str(e.path), "prefill": e.prefill,
                                                   "decode": e.decode, "hf_model": e.hf_model or None,
                                                   "checks": check_records(e.path)}
                                                  for e in good],
                                     "refused": [{"path": str(p), "reason": why} for p, why in bad]},
                                    indent=2) + "\n")
        return
    from rich.table import Table
    t = Table(show_edge=False)
    for c in ("name", "mesh", "arch", "prefill buckets", "decode buckets", "check", "path"):
        t.add_column(c)
    for e in good:
        t.add_row(e.name, e.mesh, e.arch, " ".join(map(str, e.prefill)), " ".join(map(str, e.decode)),
                  summary(e.path), str(e.path))
    out.print(t)
    for path, why in bad:
        err.print(Text(f"refused {path}: {why}"))


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def serve(ctx: typer.Context,
          target: str = typer.Argument(..., metavar="NAME|PACKAGE|SPEC", help="A registered bundle name "
                                       "(or NAME-MESH), a package directory, or a spec (built first if "
                                       "its package is missing or stale)."),
          host: str = typer.Option("127.0.0.1", "--host"),
          port: int = typer.Option(8000, "--port"),
          mesh: Optional[str] = typer.Option(None, "--mesh", "-m", help="For a SPEC: the mesh to build "
                                             "and serve (default: MESH_DEVICE, else the first target); "
                                             "for a NAME: which mesh's package."),
          output: Path = typer.Option(Path("packages"), "-o", "--output", help="For a SPEC: where its "
                                      "package is built (OUT/<mesh>/<bundle>)."),
          print_command: bool = typer.Option(False, "--print-command", help="Print the vLLM command "
                                             "and environment instead of starting it."),
          device: Optional[str] = typer.Option(None, "--device", metavar="tt|emulated", help="Where "
                                               "the mesh runs: a Tenstorrent device (tt) or the emulated "
                                               "mesh (default: tt where a device is present, else "
                                               "emulated)."),
          data_parallel_size: Optional[int] = typer.Option(None, "--data-parallel-size", "-dp", min=1,
                                                           help="vLLM engine ranks over the package's "
                                                           "replicas (each rank drives replicas / DP lanes)."),
          print_launch: bool = typer.Option(False, "--print-launch", help="Write the launch plan (per-host "
                                            "tt-run rank bindings and vLLM multi-node data-parallel "
                                            "arguments) for the target and exit; builds nothing."),
          hosts: Optional[str] = typer.Option(None, "--hosts", help="--print-launch: comma-separated host "
                                              "names, head first (default host0, host1, ...)."),
          rpc_port: int = typer.Option(13345, "--data-parallel-rpc-port", help="--print-launch: the head's "
                                       "data-parallel RPC port."),
          require_checked: bool = typer.Option(False, "--require-checked", help="Refuse a package without "
                                               "a passing `ttbundle check` record for its mesh and current "
                                               "manifest (exit 1)."),
          require_precompiled: bool = typer.Option(False, "--require-precompiled", help="Refuse to start "
                                                   "(exit 2) if anything would compile first: a program "
                                                   "not lowered at build, or (--device tt) kernels not in "
                                                   "the package's kernel cache, and the traces captured "
                                                   "from them; names each.")):
    """Serve a package with vLLM's OpenAI server on a Tenstorrent device or the emulated mesh;
    Ctrl-C stops it cleanly.

    vLLM's arguments come from the package (max_model_len, max_num_seqs, block size, dtype,
    --additional-config with trace_region_size); add more after `--`, e.g.
    `ttbundle serve demo -- --max-num-seqs 8`. Exit 0 after Ctrl-C; non-zero with a one-line reason when vLLM or its engine dies."""
    from .serving import serve as servemod
    servemod.stop_on_signals()  # from here on: the build and vLLM's start-up stop on them too
    try:
        progress = None
        if Path(target).suffix in (".yaml", ".yml"):
            shown = ConsoleProgress(err, prefix="build: ")

            def stoppable(e):  # a stop the build's imports swallowed stops it at its next step
                servemod.raise_swallowed()
                shown(e)
            progress = stoppable
        if print_launch:
            from .serving import launch
            lp = launch.launch_plan(target, mesh, data_parallel_size,
                                    hosts.split(",") if hosts else None, port, rpc_port, list(ctx.args),
                                    output)
            out.print(Text(launch.render(lp)))
            return
        servemod.check_extra(list(ctx.args))
        if not print_command:
            servemod.check_address(host, port)
        where = servemod.pick_device(device)
        pkg = servemod.resolve(target, mesh, output, progress, "ttnn" if where == "tt" else "emulated")
        plan = servemod.plan_serve(pkg, host, port, list(ctx.args), where, data_parallel_size,
                                   require_precompiled=require_precompiled)
        if require_checked:
            rec = servemod.require_checked(plan)
            err.print(Text(f"check record: passed {rec['validation']['date']} ({rec['dtypes']['compute']} compute)"))
    except TTBundleError as e:
        fail(e)
    except KeyboardInterrupt as e:  # the build removed its temp dir; a previous package is as it was
        err.print(Text(f"stopped by {servemod.stop_name(e)} before vLLM started; nothing was served"))
        raise typer.Exit(0)
    for note in plan.notes:
        err.print(Text(note))
    if print_command:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in plan.env.items())
        out.print(Text(f"{env} {shlex.join(plan.argv)}"))
        return
    if plan.memory is not None:
        err.print(Text(f"emulated mesh on this host: {plan.memory.pool_line()}"))
    err.print(Text(f"starting vLLM for {plan.name}-{plan.mesh} ({plan.package}) ..."))

    def ready(p):
        out.print(Text(f"serving {p.name}-{p.mesh} at {p.url} (model {p.name!r}); Ctrl-C stops"))

    try:
        code = servemod.run(plan, on_ready=ready)
    except TTBundleError as e:
        fail(e)
    except KeyboardInterrupt:  # a second stop signal while vLLM was being stopped: it is (run's finally)
        code = 0
    err.print(Text("vLLM stopped"))
    if code:
        raise typer.Exit(code)


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


@app.command("mock-cluster")
def mock_cluster(mesh: str = typer.Option(..., "--mesh", "-m", help="Mesh preset (N150, N300, T3K, P150, P100)."),
                 output: Path = typer.Option(..., "-o", "--output", help="Descriptor file to write (YAML).")):
    """Write a UMD cluster descriptor for ttnn's mock mode (no device needed).

    Then: TT_METAL_MOCK_CLUSTER_DESC_PATH=FILE python -c 'import ttnn; ...' (see docs/hardware.md)."""
    from . import mockcluster
    try:
        p = mockcluster.write(mesh, output)
    except TTBundleError as e:
        fail(e)
    err.print(Text(f"wrote {p}: export TT_METAL_MOCK_CLUSTER_DESC_PATH={p.absolute()}"))


@app.command()
def version():
    """Print ttbundle's version."""
    out.print(f"ttbundle {__version__}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
