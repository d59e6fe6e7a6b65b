"""A package's artifacts other than the weights: programs, warm-up records, the ttnn caches, the
small files (config.json, tokenizer, vllm_metadata.json, adapter, bundle.yaml, README.md) and
manifest.json. Artifacts whose key did not change are hard-linked from the previous package (same
inode, same mtime), so a changed bucket rewrites one program and a no-op build writes nothing."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from . import __version__, cache, lower as lowermod, tracebudget, warmup
from .errors import DoesNotFit
from .fsutil import MAX_TOKENIZER_BYTES, fault as _fault, read_user_bytes
from .manifest import MANIFEST, METADATA
from .package.facts import buckets_record, serving_record
from .package.names import FORMAT, module_name, tt_arch
from .package.templates import hf_config_json, metadata_json, render_adapter, render_readme
from .plan.host import host_facts
from .plan.make import replica_json
from .program import Program, program_name
from . import vision
from .backends.ttnn import cache as ttcache, kernelcache as kc
from .package.names import DRAFT_DIR
from .package.verify import read_manifest


class PackageWriter:
    """Writes one package's files into ``tmp``, reusing what the previous package (``prev``) has."""

    def __init__(self, bundle, plan, inp, prev, pkg, tmp, res, emit, force, warmup, backend="emulated", sfpi=None):
        self.bundle, self.plan, self.inp, self.prev = bundle, plan, inp, prev
        self.sfpi = sfpi
        self.pkg, self.tmp, self.res, self.emit = pkg, tmp, res, emit
        self.force, self.do_warmup = force, warmup
        self.backend = backend
        self.files: dict[str, dict] = {}
        self.prev_files = (prev or {}).get("files", {}) if not force else {}
        self.prev_art = (prev or {}).get("artifacts", {}) if not force else {}
        self.artifacts: dict[str, dict] = {}
        self.hf_arch = bundle.family.hf_architecture(bundle.arch)
        self.draft = None  # speculative decoding's draft package (a BuildResult), copied into DRAFT_DIR

    # -- files ---------------------------------------------------------------------------------
    def _link(self, rel: str) -> bool:
        """Reuse the previous package's file ``rel`` (hard link: same inode and mtime)."""
        rec = self.prev_files.get(rel)
        src = self.pkg / rel
        if rec is None or not src.is_file() or os.stat(src).st_size != rec["size"]:
            return False
        dst = self.tmp / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)
        self.files[rel] = {"sha256": rec["sha256"], "size": rec["size"]}
        return True

    def _write(self, rel: str, data: bytes) -> None:
        """Write a small file, or link the previous one when the bytes are the same."""
        sha = hashlib.sha256(data).hexdigest()
        old = self.prev_files.get(rel)
        if old and old["sha256"] == sha and self._link(rel):
            return
        p = self.tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.exists():  # never write through a hard link into the previous package
            p.unlink()
        with open(p, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        self.files[rel] = {"sha256": sha, "size": len(data)}
        self.res.bytes_written += len(data)
        _fault(f"wrote:{rel}")


    def _draft_files(self, draft) -> None:
        """The draft's package (``speculative: {method: draft}``) copied whole into ``DRAFT_DIR``
        (hard links where the file system allows), every file of it listed in this package's
        manifest too, so ``package.verify`` checks it like any other file."""
        src = Path(draft.package)
        m = read_manifest(src)
        files = {rel: {"sha256": r["sha256"], "size": r["size"]} for rel, r in m["files"].items()}
        raw = (src / MANIFEST).read_bytes()
        files[MANIFEST] = {"sha256": hashlib.sha256(raw).hexdigest(), "size": len(raw)}
        for rel, rec in sorted(files.items()):
            dst = self.tmp / DRAFT_DIR / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src / rel, dst)
            except OSError:
                shutil.copy2(src / rel, dst)
            self.files[f"{DRAFT_DIR}/{rel}"] = rec
        self.artifacts["draft"] = {"key": draft.key, "bundle": draft.bundle,
                                   "files": sorted(f"{DRAFT_DIR}/{r}" for r in files)}
        (self.res.reused if draft.status == "up-to-date" else self.res.rebuilt).append("draft")

    def _tensorbin(self, weights_key: str) -> None:
        """Per-device .tensorbin caches of the weights just written (or linked)."""
        ident = ttcache.identity(self.plan, self.inp.fields, weights_key)
        key = ttcache.artifact_key(ident)
        old = self.prev_art.get("tensorbin", {})
        if old.get("key") == key and all(self._link(rel) for rel in old.get("files", [])):
            files = old["files"]
            self.res.reused.append("tensorbin")
        else:
            written = ttcache.write_caches(self.tmp, self.plan, self.bundle.spec.sharding, self.emit, ident)
            self.files.update(written)
            self.res.bytes_written += sum(r["size"] for r in written.values())
            files = sorted(written)
            self.res.rebuilt.append("tensorbin")
        self.artifacts["tensorbin"] = {"key": key, "identity": ident, "files": files}

    def _kernel_cache(self, keys: dict) -> None:
        """tt-metal's kernel cache for every traced program, where a real SFPI compiler is present
        (``backends/ttnn/kernelcache.py``); else recorded as not filled, with the reason."""
        sfpi, python = self.sfpi or kc.status()
        m = self.plan.mesh  # the programs' keys cover the mesh too; said here so no two chips share one
        key = cache.digest({"programs": sorted(v for k, v in keys.items() if k.startswith("program:")),
                            "arch": m.chip.arch, "mesh_shape": list(m.shape),
                            "sfpi": sfpi.key(), "ttnn": self.inp.fields.get("ttnn"),
                            "code": cache.code_digest(cache.module_sources([kc.__name__]))})
        old = self.prev_art.get("kernel_cache", {})
        files = None
        if sfpi.found and old.get("key") == key and old.get("filled") and all(self._link(r) for r in old["files"]):
            self.res.reused.append("kernel_cache")
            files = {r: self.files[r] for r in old["files"]}
        elif sfpi.found:
            files = kc.fill(python, self.inp.bundle_yaml, self._written_programs(), self.plan.mesh.name,
                            self.plan.trace_region_size, self.tmp / kc.CACHE_DIR, self.emit)
            self.files.update(files)
            self.res.bytes_written += sum(r["size"] for r in files.values())
            self.res.rebuilt.append("kernel_cache")
        self.artifacts["kernel_cache"] = {"key": key, **kc.record(sfpi, files)}
        if self.artifacts["kernel_cache"]["filled"]:  # the programs whose kernels it holds (both samplings)
            self.artifacts["kernel_cache"]["programs"] = [program_name(p, b) for p, b in self.inp.traces]
        if not self.artifacts["kernel_cache"]["filled"]:
            self.res.warnings.append("kernel cache not pre-filled (the first warm-up on a Tenstorrent host "
                                     f"compiles every kernel): {self.artifacts['kernel_cache']['reason']}")

    def _written_programs(self) -> dict:
        """The typed programs this package holds, read back from what ``_programs`` wrote (or
        linked): what the kernel-cache fill runs, nothing re-lowered."""
        out = {}
        for phase, b in self.inp.traces:
            rel = f"programs/{program_name(phase, b)}.json"
            out[(phase, b)] = Program.from_json(json.loads((self.tmp / rel).read_text(encoding="utf-8")), rel)
        return out

    # -- programs ------------------------------------------------------------------------------
    def _programs(self, keys: dict) -> None:
        traces = self.inp.traces
        self.emit({"event": "phase", "phase": "programs", "total": len(traces), "unit": "traces"})
        for i, (phase, b) in enumerate(traces):
            name = program_name(phase, b)
            rel = f"programs/{name}.json"
            art = f"program:{name}"
            reused = self.prev_art.get(art, {}).get("key") == keys[art] and self._link(rel)
            if not reused:
                prog = lowermod.lower(self.bundle, self.plan, phase, b).to_json()
                self._write(rel, (json.dumps(prog, sort_keys=True, indent=1) + "\n").encode())
            (self.res.reused if reused else self.res.rebuilt).append(art)
            self.artifacts[art] = {"key": keys[art], "files": [rel]}
            self.emit({"event": "advance", "phase": "programs", "item": name, "i": i + 1,
                       "n": len(traces), "reused": reused})

    def _warmup(self, keys: dict) -> None:
        """Run each (phase, bucket) whose warm-up key is new on its fixed input on the emulated
        backend, from the weights just written, layer by layer, and record the output
        (``warmup/<program>.json``, the reference ``ttbundle.warmup`` compares with at serving
        start and in ``cache verify``)."""
        todo, records = [], {}
        for phase, b in self.inp.traces:
            art = f"warmup:{program_name(phase, b)}"
            old = self.prev_art.get(art)
            if old and old.get("key") == keys[art] and old.get("ran") and old.get("reference") \
                    and self._link(old["reference"]):
                records[art] = old
                self.res.reused.append(art)
            elif self.do_warmup:
                todo.append((phase, b))
            else:
                records[art] = {"key": keys[art], "backend": "emulated", "ran": False}
        if todo:
            ran = warmup._warm(self.bundle, self.plan, self.tmp, todo, self.emit)
            for (phase, b), out in zip(todo, ran):
                art = f"warmup:{program_name(phase, b)}"
                rec = out["record"]
                self._write(rec["reference"], warmup.reference_bytes(out["reference"]))
                records[art] = {"key": keys[art], **rec, "files": [rec["reference"]]}
                self.res.rebuilt.append(art)
                self.res.warmed.append(program_name(phase, b))
        self.artifacts.update(records)

    # -- small files ---------------------------------------------------------------------------
    def _small_files(self) -> None:
        b, plan = self.bundle, self.plan
        mod = module_name(b.spec.name, plan.mesh.name)
        cls = self.hf_arch
        self.main_class = f"{mod}:{cls}"
        self._write(METADATA, metadata_json(self.hf_arch, self.main_class).encode())
        self._write(f"{mod}.py", render_adapter(b.spec.name, plan.mesh.name, self.hf_arch, cls,
                                                __version__).encode())
        self._write("config.json", hf_config_json(b).encode())
        for rel, data in vision.package_files(b).items():  # what vLLM's image processor reads
            self._write(rel, data)
        self._write("bundle.yaml", self.inp.bundle_yaml.encode())
        for r in self.inp.tokenizer_records:
            self._write(r["name"], read_user_bytes(Path(r["dir"]) / r["name"], "tokenizer file",
                                                   r["dir"], MAX_TOKENIZER_BYTES))
        self._write("README.md", render_readme(self._card()).encode())

    def _card(self) -> dict:
        b, p, m = self.bundle, self.plan, self.plan.mesh
        progs = []
        for phase, bk in self.inp.traces:
            name = program_name(phase, bk)
            prog = Program.from_json(json.loads((self.tmp / f"programs/{name}.json").read_text()), name)
            s = lowermod.summary(prog)
            w = self.artifacts.get(f"warmup:{name}", {})
            s["warmed"] = "emulated" if w.get("ran") else "not warmed"
            progs.append(s)
        mem = p.memory
        return {
            "bundle": b.spec.name, "description": b.spec.description, "family": p.family,
            "tt_arch": tt_arch(self.hf_arch), "main_class": self.main_class,
            "mesh": {"name": m.name, "rows": m.rows, "cols": m.cols, "devices": m.num_devices,
                     "chip": m.chip.label, "describe": m.describe(), "replicas": m.replicas,
                     "concurrency": p.concurrency(b.spec.runtime.max_num_seqs)},
            "memory": [("weights", mem.weights), ("KV cache", mem.kv_cache),
                       ("activations", mem.activations), ("trace region", mem.trace_region),
                       ("total", mem.total), ("DRAM", mem.dram)],
            "tensors": [{"name": t.name, "dtype": t.dtype, "notation": t.notation(),
                         "device_shape": "x".join(map(str, t.device_shape)), "count": t.count}
                        for t in p.tensors],
            "collectives": sum(c.count for c in p.collectives),
            "traffic": p.decode_traffic_bytes_per_token,
            "programs": progs, "trace_region": mem.trace_region,
            "prefill_chunk": str(b.buckets.prefill_chunk or "none"),
            "key": cache.content_key(self.inp.fields), "spec_sha256": self.inp.fields["spec"],
            "versions": [(k, str(v)) for k, v in cache.versions().items()],
        }

    def _precompiled(self) -> dict:
        """What this package brings already compiled, for ``serve --require-precompiled``:
        ``programs``, every (phase, bucket) lowered here (nothing is lowered at start);
        ``kernels`` (ttnn builds), the programs whose ttnn kernels the package's kernel cache holds
        (empty when it was not filled, with ``kernels_missing_reason``). Traces are not files:
        tt-metal captures them at every start, from kernels that are then compiled or cached."""
        out = {"programs": sorted(program_name(p, b) for p, b in self.inp.traces)}
        if self.backend == "ttnn":
            kc = self.artifacts.get("kernel_cache", {})
            out["kernels"] = sorted(kc.get("programs", [])) if kc.get("filled") else []
            if not kc.get("filled"):
                out["kernels_missing_reason"] = kc.get("reason", "no kernel cache")
        return out

    def _trace_region(self) -> dict:
        """What the shipped programs' traces need (``tracebudget``, counted from the programs as
        written) against the region the plan reserved (``build.device_plan``); a reservation below
        the need would fail the first capture on the device, so it is refused here."""
        rt = self.bundle.spec.runtime
        tn = tracebudget.trace_need(self.bundle, self.plan.mesh, self._written_programs())
        size = self.plan.trace_region_size
        if tn.traces and size < tn.need:
            raise DoesNotFit(f"{self.bundle.spec.name}: the trace region planned, {size:,} B, is below what its "
                             f"programs' traces need: {tn.arithmetic()}; {tn.need - size:,} B short")
        source = "spec" if rt.trace_region_size is not None else "need + headroom"
        return tracebudget.record(tn, size, source, rt.sample_on_device_mode, rt.trace_mode)

    def _manifest(self) -> None:
        b, p, m = self.bundle, self.plan, self.plan.mesh
        manifest = {
            "format": FORMAT,
            "bundle": b.spec.name,
            "arch": self.hf_arch,
            "tt_arch": tt_arch(self.hf_arch),
            "main_class": self.main_class,
            "mesh": {"name": m.name, "shape": list(m.shape), "arch": m.chip.arch, "devices": m.num_devices},
            **({"replicas": replica_json(m, b.spec.runtime.max_num_seqs)} if m.target_shape else {}),
            "buckets": buckets_record(b),
            "serving": serving_record(b, (p.draft or {}).get("kv_blocks"), host_facts(b, p).record()),
            "trace_region_bytes": p.memory.trace_region,  # the DRAM it costs (per-bank rounding)
            "trace_region_size": p.trace_region_size,  # what the mesh is opened with
            **({"trace_region": self._trace_region()} if self.backend == "ttnn" else {}),
            "versions": cache.versions(),
            "spec_sha256": self.inp.fields["spec"],
            "key": cache.content_key(self.inp.fields),
            "key_fields": self.inp.fields,
            "artifacts": self.artifacts,
            "precompiled": self._precompiled(),
            "sources": {"weights": self.inp.weight_records, "tokenizer": self.inp.tokenizer_records},
            "build": {"spec_file": str(Path(b.file).absolute()), "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                      "changed_fields": self.res.changed_fields, "rebuilt": sorted(self.res.rebuilt),
                      "reused": sorted(self.res.reused)},
            "files": dict(sorted(self.files.items())),
        }
        data = (json.dumps(manifest, indent=1) + "\n").encode()
        with open(self.tmp / MANIFEST, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        _fault("wrote:manifest")

