"""`ttbundle build` and `ttbundle check` of MoE checkpoints at published dims, in their published
storage formats (issue 37, item 4): peak RSS flat in depth, build wall against copying the
checkpoint.

Models (the bundles/*.yaml dims, depth cut to L layers):

* ``gpt-oss-120b``: experts MXFP4 (uint8 blocks + e8m0 scales, as OpenAI publishes them), the
  rest bf16;
* ``deepseek-v3``: 1 dense + (L-1) MoE layers, every decoder Linear fp8 e4m3 with 128x128
  ``weight_scale_inv`` blocks (as DeepSeek publishes it), router / norms / embeddings bf16,
  ``e_score_correction_bias`` f32;
* ``qwen3-30b-a3b``: bf16 (as Qwen publishes it).

The checkpoint is written tensor by tensor (random values, a chunk at a time; key names and shapes
from transformers' own model of the config on the ``meta`` device), then, each in its own
subprocess, in the same run: ``cp -r`` + ``sha256sum`` of it (the reference), ``ttbundle build``
on the smallest mesh ``plan`` says fits (the bundle's dtypes), ``ttbundle check --steps 2``.

    python benches/bench_moe_real_size.py gpt-oss-120b --layers 2 4
    python benches/bench_moe_real_size.py deepseek-v3 --layers 2 --no-check    # ~16 GB on disk
    python benches/bench_moe_real_size.py qwen3-30b-a3b --layers 4 --json

Checkpoints and packages go to ``--work`` (default: a temp dir under ``$TMPDIR``) and are deleted
per L unless ``--keep``. Where the disk cannot hold a second copy of the checkpoint, the reference
copies it file by file, removing each copy before the next (``cp_per_file`` in the row).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_real_size import measure  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHARD_BYTES = 4 << 30  # checkpoint shard files of at most ~4 GiB (DeepSeek publishes ~4.3 GB)
CHUNK = 1 << 24  # elements generated at a time
LIMIT_GIB = 12  # a build or check over this RSS is killed (Watchdog): the host is shared
MESHES = ("N150", "N300", "T3K", "TG", "DUAL_GALAXY", "QUAD_GALAXY")
#: (bundle yaml, storage format of its published checkpoint)
MODELS = {"gpt-oss-120b": "mxfp4", "deepseek-v3": "fp8-block", "qwen3-30b-a3b": "bf16"}
LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.(.*\.)?[a-z_]+_proj(_with_mqa)?\.weight$")
MXFP4_EXPERTS = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)$")


def bundle_doc(model: str, layers: int) -> dict:
    import yaml

    d = yaml.safe_load((ROOT / "bundles" / f"{model}.yaml").read_text())
    m = d["model"]
    m["num_hidden_layers"] = layers
    if "first_k_dense_replace" in m:
        m["first_k_dense_replace"] = 1  # one dense layer, then MoE layers
    if "layer_types" in m:
        m["layer_types"] = m["layer_types"][:layers]
    if "num_nextn_predict_layers" in m:
        m["num_nextn_predict_layers"] = 0
    return d


def layout(model: str, layers: int) -> list[tuple[str, str, tuple, str]]:
    """(key, safetensors dtype, shape, kind) of every tensor of the published checkpoint, in
    transformers' order; kind: how its values are made (normal, norm, fp8, scale, blocks, e8m0)."""
    import torch

    from ttbundle import reference, spec

    reference._quiet()
    b = spec.loads(_yaml(bundle_doc(model, layers)), f"{model}.yaml")
    cfg = reference.hf_config(b)
    with torch.device("meta"):
        m = reference.auto_class(cfg.model_type).from_config(cfg, dtype=torch.bfloat16)
    fmt = MODELS[model]
    out = []
    for k, v in reference.checkpoint_state_dict(m).items():
        shape = tuple(v.shape)
        if fmt == "mxfp4" and MXFP4_EXPERTS.search(k):
            E, K, N = shape
            out += [(k + "_blocks", "U8", (E, N, K // 32, 16), "blocks"), (k + "_scales", "U8", (E, N, K // 32), "e8m0")]
        elif fmt == "fp8-block" and LINEAR.search(k):
            o, i = shape
            out += [(k, "F8_E4M3", shape, "fp8"),
                    (k[:-len("weight")] + "weight_scale_inv", "F32", (math.ceil(o / 128), math.ceil(i / 128)), "scale")]
        elif k.endswith("e_score_correction_bias"):
            out.append((k, "F32", shape, "small32"))
        else:
            out.append((k, "BF16", shape, "normal" if len(shape) >= 2 else "small" if "bias" in k or "sinks" in k
                        else "norm"))
    return out


def _yaml(d) -> str:
    import yaml
    return yaml.safe_dump(d, sort_keys=False)


BYTES = {"BF16": 2, "F32": 4, "U8": 1, "F8_E4M3": 1}


def make_checkpoint(d: Path, model: str, layers: int, seed: int = 0) -> int:
    """Write the checkpoint into ``d`` (safetensors written by hand, a chunk of one tensor at a
    time, shards of at most SHARD_BYTES + an index, config.json with the published
    quantization_config); returns its bytes."""
    import torch

    from ttbundle import reference, spec

    g = torch.Generator().manual_seed(seed)
    d.mkdir(parents=True, exist_ok=True)
    ts = layout(model, layers)
    shards, size = [[]], 0
    for t in ts:
        n = BYTES[t[1]] * math.prod(t[2])
        if shards[-1] and size + n > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += n
    weight_map, total = {}, 0
    for s, shard in enumerate(shards):
        name = f"model-{s + 1:05d}-of-{len(shards):05d}.safetensors"
        header, off = {"__metadata__": {"format": "pt"}}, 0
        for key, dt, shape, _ in shard:
            n = BYTES[dt] * math.prod(shape)
            header[key] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + n]}
            off += n
        hb = json.dumps(header, separators=(",", ":")).encode()
        hb += b" " * (-len(hb) % 8)
        with open(d / name, "wb") as f:
            f.write(struct.pack("<Q", len(hb)) + hb)
            for key, dt, shape, kind in shard:
                left = math.prod(shape)
                while left:
                    m = min(CHUNK, left)
                    f.write(_values(kind, m, shape, g).numpy().tobytes())
                    left -= m
                weight_map[key] = name
        total += off
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    b = spec.loads(_yaml(bundle_doc(model, layers)), f"{model}.yaml")
    cfg = reference.hf_config(b).to_dict()
    q = bundle_doc(model, layers)["model"].get("quantization_config")
    if q:
        cfg["quantization_config"] = q
    cfg["torch_dtype"] = "bfloat16"
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    return total


def _values(kind: str, m: int, shape, g):
    import torch

    if kind == "blocks":  # any byte is two valid e2m1 values
        return torch.randint(0, 256, (m,), dtype=torch.uint8, generator=g)
    if kind == "e8m0":  # 2^-7: e2m1 values (|x| <= 6) times it, std ~0.02
        return torch.full((m,), 120, dtype=torch.uint8)
    if kind == "scale":  # fp8 N(0, 1) values times it: std ~0.02
        return torch.full((m,), 0.02, dtype=torch.float32)
    x = torch.randn(m, generator=g)
    if kind == "fp8":
        return x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    if kind == "norm":
        return (1 + 0.1 * x).to(torch.bfloat16).view(torch.int16)
    if kind == "small32":  # f32 biases (DeepSeek's e_score_correction_bias)
        return 0.02 * x
    if kind == "small":
        return (0.02 * x).to(torch.bfloat16).view(torch.int16)
    fan_in = shape[-1]
    return (x / math.sqrt(fan_in)).to(torch.bfloat16).view(torch.int16)


class Watchdog:
    """Kills any descendant of this process whose RSS passes LIMIT_GIB (polled every 0.5 s), so a
    run that would not fit does not take the shared host down; its failure is then reported."""

    def __enter__(self):
        import threading
        self.stop = threading.Event()
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.t.join()

    def _run(self):
        import signal
        me = os.getpid()
        while not self.stop.wait(0.5):
            kids: dict = {}
            for p in os.listdir("/proc"):
                if not p.isdigit():
                    continue
                try:
                    st = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
                    kids.setdefault(int(st[1]), []).append((int(p), int(st[21]) * os.sysconf("SC_PAGE_SIZE")))
                except (OSError, IndexError, ValueError):
                    continue
            todo = [me]
            while todo:
                for pid, rss in kids.get(todo.pop(), []):
                    todo.append(pid)
                    if rss > LIMIT_GIB << 30:
                        print(f"watchdog: pid {pid} at {rss / 2**30:.1f} GiB RSS > {LIMIT_GIB} GiB: killed",
                              file=sys.stderr, flush=True)
                        os.kill(pid, signal.SIGKILL)


def smallest_mesh(spec_path: Path) -> str:
    from ttbundle import spec
    from ttbundle.plan.make import make_plan

    b = spec.load(spec_path)
    for m in MESHES:
        try:
            if make_plan(b, m).fits:
                return m
        except Exception:  # a mesh the dims do not split over
            continue
    raise SystemExit(f"{spec_path}: no mesh of {MESHES} fits")


def one_depth(work: Path, model: str, layers: int, check: bool, env: dict, mesh: str | None,
              warmup: bool = True, prompt_len: int | None = None) -> dict:
    src = work / f"ckpt-{model}-{layers}"
    shutil.rmtree(src, ignore_errors=True)
    t = time.monotonic()
    total = make_checkpoint(src, model, layers)
    gen_s = time.monotonic() - t
    files = sorted(str(f) for f in src.iterdir())
    for f in files:  # the page cache warm for every side (as far as it holds)
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass
    subprocess.run(["sync"], check=True)
    dst = work / "cp"
    shutil.rmtree(dst, ignore_errors=True)
    # a second whole copy must fit the disk beside the checkpoint and what the build writes next
    # (DeepSeek-V3's 4-layer checkpoint is 37 GB); where it does not, the files are copied one at
    # a time, each copy removed before the next (the removal not timed): the same bytes copied,
    # and a faster reference if anything (the removed copies' dirty pages are never written back)
    per_file = shutil.disk_usage(work).free < 2 * total + (8 << 30)
    if per_file:
        dst.mkdir()
        cp_s = 0.0
        for f in files:
            cp_s += measure(["cp", f, str(dst / Path(f).name)])[0]
            (dst / Path(f).name).unlink()
    else:
        cp_s, _, _ = measure(["cp", "-r", str(src), str(dst)])
    shutil.rmtree(dst)
    sha_s, _, _ = measure(["sha256sum", *files])
    ref_s = cp_s + sha_s
    doc = bundle_doc(model, layers)
    doc["weights"] = {**doc.get("weights", {}), "source": str(src)}
    doc["tokenizer"] = False
    spec = work / f"{model}-{layers}.yaml"
    spec.write_text(_yaml(doc))
    mesh = mesh or smallest_mesh(spec)
    doc["targets"] = [mesh]
    spec.write_text(_yaml(doc))
    out = work / f"out-{model}-{layers}"
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run(["sync"], check=True)
    tt = [sys.executable, "-m", "ttbundle.cli"]
    row = {"model": model, "layers": layers, "mesh": mesh, "warmup": warmup, "checkpoint_bytes": total, "generate_s": round(gen_s, 1),
           "cp_s": round(cp_s, 2), "cp_per_file": per_file, "sha256_s": round(sha_s, 2), "reference_s": round(ref_s, 2)}
    try:
        with Watchdog():
            b_wall, b_rss, stdout = measure(tt + ["build", str(spec), "--mesh", mesh, "-o", str(out), "--json"]
                                            + ([] if warmup else ["--no-warmup"]), env)
    except SystemExit as e:
        row.update(build_failed=str(e)[-2000:], load=round(os.getloadavg()[0], 2))
        return row
    done = [json.loads(x) for x in stdout.splitlines() if '"event": "done"' in x][-1]
    row.update(build_s=round(b_wall, 1), build_rss=b_rss, build_over_reference=round(b_wall / ref_s, 2),
               timings=done["timings"])
    if check:
        try:
            # exit 1 (a failed verdict) keeps its report: the exit code is the last line of stdout
            with Watchdog():
                c_wall, c_rss, c_out = measure(["sh", "-c", '"$@"; echo "$?"', "sh"] + tt + [
                    "check", done["package"], "--steps", "2", "--json", "--no-record"]
                    + ([] if prompt_len is None else ["--prompt-len", str(prompt_len)]), env)
            body, _, rc = c_out.rstrip().rpartition("\n")
            if rc.strip() not in ("0", "1"):
                raise SystemExit(f"check exited {rc.strip()}:\n{body[-2000:]}")
            rep = json.loads(body)
            row.update(check_s=round(c_wall, 1), check_rss=c_rss, check_passed=rep["passed"],
                       check_prompt=rep.get("prompt_len"), check_exit=int(rc),
                       check_failure=None if rep["passed"] else str(rep.get("failure") or rep.get("verdict"))[:500],
                       check_timings=rep.get("timings"))
        except SystemExit as e:  # a failed check keeps the build's figures and says why
            row.update(check_failed=str(e)[-2000:])
    row["load"] = round(os.getloadavg()[0], 2)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", choices=sorted(MODELS))
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--mesh", help="mesh (default: the smallest that plan says fits)")
    ap.add_argument("--no-check", action="store_true", help="measure the build only")
    ap.add_argument("--no-warmup", action="store_true", help="build with --no-warmup (the conversion alone)")
    ap.add_argument("--work", type=Path, help="work directory (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep checkpoints and packages")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    ap.add_argument("--prompt-len", type=int, help="check's prompt tokens (default: check's own, a bit over "
                    "one prefill chunk)")
    ap.add_argument("--limit-gib", type=int, default=LIMIT_GIB, help="kill a build or check over this RSS")
    args = ap.parse_args()
    globals()["LIMIT_GIB"] = args.limit_gib
    work = args.work or Path(tempfile.mkdtemp(prefix="bench_moe_real_size_", dir=os.environ.get("TMPDIR")))
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    rows = []
    try:
        for L in sorted(args.layers):
            rows.append(one_depth(work, args.model, L, not args.no_check, env, args.mesh, not args.no_warmup,
                                  args.prompt_len))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            if not args.keep:
                for p in (work / f"ckpt-{args.model}-{L}", work / f"out-{args.model}-{L}"):
                    shutil.rmtree(p, ignore_errors=True)
    finally:
        if not args.keep and args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    gib = 2 ** 30
    print(f"{args.model} dims, {MODELS[args.model]} checkpoint (random values); {os.cpu_count()} CPUs")
    print(f"build {'without' if args.no_warmup else 'with'} warm-up; check prompt: "
          f"{args.prompt_len or 'check default'} tokens")
    print("| layers | mesh | checkpoint | cp + sha256 | build | build / reference (<= 3x) | build peak RSS (<= 8 GiB) "
          "| check --steps 2 | check peak RSS | load |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        b = (f"{r['build_s']:.1f} s | **{r['build_over_reference']:.2f}x** | **{r['build_rss'] / gib:.2f} GiB**"
             if "build_s" in r else "FAILED | - | -")
        c = (f"{r['check_s']:.1f} s ({'passed' if r['check_passed'] else 'FAILED'}) | {r['check_rss'] / gib:.2f} GiB"
             if "check_s" in r else "FAILED | -" if "check_failed" in r else "- | -")
        print(f"| {r['layers']} | {r['mesh']} | {r['checkpoint_bytes'] / 1e9:.2f} GB | {r['cp_s']:.1f} + "
              f"{r['sha256_s']:.1f} s = {r['reference_s']:.1f} s | {b} | {c} | {r['load']} |")
    for r in rows:
        for k in ("build_failed", "check_failed"):
            if k in r:
                print(f"{k}, {r['layers']} layers:\n{r[k]}")


if __name__ == "__main__":
    main()
