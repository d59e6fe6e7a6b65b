"""The model class behind a package's ``vllm_metadata.json``: Tenstorrent's vLLM model
interface (``initialize_vllm_model``, ``allocate_kv_cache``, ``prefill_forward``,
``decode_forward``, ``warmup_model_*``) over the emulated mesh, running the package's own
programs on its own weight shards. The adapter module that
``ttbundle build`` generates in each package subclasses :class:`BundleModel` with the package's
constants (``package_dir``, ``bundle_name``, ``mesh_name``, ``arch``, ``tt_arch``).

Every call runs one *program*: a prefill of one sequence padded to a prefill bucket, or a
decode of a batch padded to a decode bucket, exactly the shapes a device would have traced.
After warm-up, a shape that was not warmed up is refused rather than compiled in the middle
of a request (on hardware that would be a trace capture during serving).
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path

import torch

from .. import kvpool, mesh as meshmod
from ..backends.emulated import EmulatedModel
from ..backends.emulated.state import KVCache
from ..tiles import blocks_per_seq
from ..families.vision_part import decode_rope
from ..vision import vision_bucket
from . import packages
from .capabilities import device_seeds, model_capabilities
from .images import prompt_inputs, request_pixels
from .interface import MeshModel
from .options import TTOptions
from .phases import TILE
from .sampling import DeviceSampling, accept, sample_on_device
from .speculation import verify_batch
from .ttdevice import TTDeviceModel

logger = logging.getLogger("vllm.ttbundle.adapter")


class _ClassCapabilities:
    """``BundleModel.model_capabilities`` read on a generated adapter class: derived from its
    package's spec (``capabilities.model_capabilities``, device path), the package opened once
    (:func:`_opened`)."""

    def __get__(self, obj, cls):
        d = cls.package_dir
        if d is None:
            return {}
        return model_capabilities(_opened(d), device=True)


def _opened(package_dir: str):
    """The package at ``package_dir``, verified and opened once per build of it: the one
    per-package cache of the adapter class (its capabilities and KV pool read it). Keyed by the
    directory and its manifest file, so a package rebuilt in place (a new manifest.json) is
    opened again."""
    d = Path(package_dir).absolute()
    try:
        st = (d / "manifest.json").stat()
        ident = (st.st_ino, st.st_mtime_ns, st.st_size)
    except OSError:
        ident = None  # open_package names what is missing
    return _open_once(str(d), ident)


@functools.lru_cache(maxsize=8)
def _open_once(package_dir: str, ident):
    return packages.open_package(Path(package_dir))


class BundleModel(MeshModel):
    """A bundle's causal LM on an emulated mesh, behind Tenstorrent's model interface (the model
    protocol, ``runtime.interface.MeshModel``)."""

    # set by the generated adapter subclass in each package
    package_dir: str | None = None
    bundle_name: str | None = None
    mesh_name: str | None = None
    arch: str | None = None
    tt_arch: str | None = None

    #: on the class: the package's capabilities on a Tenstorrent device (what Tenstorrent's
    #: plugin reads before building the model); on an instance: what that instance does
    model_capabilities = _ClassCapabilities()
    #: a seeded request samples on the emulated mesh with its own generator
    seeded_on_device = device_seeds(device=False)

    def __init__(self, package, model: EmulatedModel, trace_mode: str = "all"):
        """``package``: the opened package (``packages.Package``: its manifest's buckets and
        serving facts); ``model``: its programs and weight shards on the emulated mesh
        (``EmulatedModel.from_package``)."""
        self.package, self.bundle = package, package.bundle
        self.model = model
        b = package.buckets
        self.prefill_buckets, self.decode_buckets = list(b.prefill), list(b.decode)
        self.vocab_size = model.dims.vocab_size
        self.trace_mode = trace_mode
        self.warmed: set[tuple[str, int]] = set()
        self.sealed = False  # after warm-up: only warmed shapes may run
        self.programs_run: dict[tuple[str, int], int] = {}
        self.model_capabilities = model_capabilities(package, device=False, vocab_size=model.dims.vocab_size)

    # -- Tenstorrent's constructor -------------------------------------------------------------
    @classmethod
    def get_max_tokens_all_users(cls, model_name: str = "", num_devices: int = 1, tt_data_parallel: int = 1,
                                 max_model_len: int = 0, max_num_seqs: int | None = None, **kwargs) -> int:
        """The KV pool Tenstorrent's plugin sizes its cache from (it allocates
        ceil((tokens + block x max_num_seqs) / block) blocks): the tokens for which that formula
        gives exactly the blocks the package's programs were built for (``Package.kv_blocks``),
        at ``max_num_seqs`` (default: the spec's)."""
        if cls.package_dir is None:
            raise ValueError("get_max_tokens_all_users: not a package's adapter (no package_dir)")
        pkg = _opened(cls.package_dir)
        return kvpool.pool_tokens(pkg.serving, pkg.kv_blocks, max_num_seqs)

    @classmethod
    def initialize_vllm_model(cls, hf_config, mesh_device, max_batch_size, max_seq_len,
                              tt_data_parallel=1, optimizations=None, *, package=None,
                              dtype=torch.float32, trace_mode="all"):
        """``mesh_device``: the emulated mesh (a ``mesh.Mesh``, or None: the package's own), or
        a ttnn MeshDevice (Tenstorrent's plugin on a device): then the package's ttnn device path
        (``ttdevice.TTDeviceModel``: its tensorbin weights, compile warm-up, traces) on that
        mesh, with Tenstorrent's default options and ``optimizations``. The package:
        ``package``, else the class's ``package_dir``, else the directory vLLM was given."""
        pkg = package or packages.open_package(Path(cls.package_dir or hf_config._name_or_path))
        if mesh_device is not None and not isinstance(mesh_device, meshmod.Mesh):
            return _on_device(pkg, hf_config, mesh_device, max_batch_size, max_seq_len, tt_data_parallel,
                              optimizations, trace_mode)
        replicas = pkg.loaded.mesh.replicas
        if tt_data_parallel < 1 or replicas % tt_data_parallel:
            raise ValueError(f"{pkg.name}: tt_data_parallel={tt_data_parallel} lanes, but the package runs "
                             f"{replicas} replica(s) ({pkg.loaded.mesh.describe()}); lanes must divide "
                             "the replicas")
        if isinstance(mesh_device, meshmod.Mesh) and tuple(mesh_device.shape) != tuple(pkg.loaded.mesh.shape):
            raise ValueError(f"{pkg.name}: built for {pkg.loaded.mesh.describe()}, handed a "
                             f"{mesh_device.describe()} mesh")
        decode = pkg.buckets.decode  # none for task: embed (prefill only)
        if (decode and max_batch_size > max(decode)) or max_seq_len > pkg.dims.max_model_len:
            raise ValueError(f"{pkg.name}: max_batch_size={max_batch_size} / max_seq_len={max_seq_len} "
                             f"exceed the package's decode buckets {pkg.buckets.decode} / "
                             f"max_model_len={pkg.dims.max_model_len}")
        # every lane runs the same programs on the same (read-only) weight shards: the lanes'
        # own state is their KV cache region (``allocate_kv_cache`` once per lane)
        model = cls(pkg, pkg.emulated_model(dtype), trace_mode=trace_mode)
        model.tt_data_parallel = tt_data_parallel
        return model

    # -- KV cache -------------------------------------------------------------------------------
    def allocate_kv_cache(self, kv_cache_shape, dtype=None, num_layers=None) -> KVCache:
        """``kv_cache_shape``: (num_blocks, num_kv_heads, block_size, head_dim) as vLLM sizes it;
        each device holds its own heads' share (the plan's KV split)."""
        num_blocks, _, block_size, _ = kv_cache_shape
        return self.model.allocate_kv_cache(num_blocks, block_size)

    # -- programs -------------------------------------------------------------------------------
    def _program(self, phase: str, bucket: int):
        key = (phase, bucket)
        traced = self.trace_mode == "all" or (self.trace_mode == "decode_only" and phase in ("decode", "verify"))
        if self.sealed and traced and key not in self.warmed:
            raise RuntimeError(f"{phase} bucket {bucket} was not captured at warm-up; refusing to "
                               "capture a trace while serving")
        self.programs_run[key] = self.programs_run.get(key, 0) + 1
        return self.model.program(phase, bucket)

    def _finish(self, logits: torch.Tensor, sampling: DeviceSampling | None):
        if sampling is None:
            return logits.float()
        return sample_on_device(logits, sampling)

    @torch.no_grad()
    def prefill_forward(self, tokens: torch.Tensor, page_table: torch.Tensor, kv_cache: KVCache,
                        prompt_lens, start_pos=None, sampling_params: DeviceSampling | None = None,
                        enable_trace: bool = True, return_prompt_logits: bool = False, mm: dict | None = None,
                        pixel_values=None, rope_positions: torch.Tensor | None = None, image_grid_thw=None,
                        read_from_device: bool = True, **kwargs):
        """One sequence's prefill chunk. ``tokens`` [1, S] with S a prefill bucket, the first
        ``prompt_lens[0]`` real; positions start at ``start_pos[0]``. Returns the last real
        token's logits [1, V] (host sampling) or its sampled id [1] (``sampling_params``);
        ``return_prompt_logits`` (ttbundle's runner, for prompt_logprobs): every real
        position's logits [n, V]. ``mm``: the chunk's image soft tokens
        (``runtime.images.chunk_inputs``; ttbundle's runner). ``pixel_values``: the request's
        images as Tenstorrent's plugin passes them (a list per request, or a tensor), encoded
        here by the package's vision program (``runtime.images.prompt_inputs``): the prompt is
        prefilled whole in this call. ``image_grid_thw`` (Qwen2.5-VL, a list per request like
        ``pixel_values``: [images, 3]): the images' patch grids. Where the family's vision part
        gives the prompt M-RoPE positions (``VisionPart.positions``) the call returns
        ``(output, rope_deltas)`` (rope_deltas [1]: decode this request with ``rope_deltas=``,
        the convention of Tenstorrent's M-RoPE models); for other models ``image_grid_thw`` is
        accepted and unused. ``rope_positions`` [3, 1, S]: M-RoPE positions (temporal, height,
        width) of the chunk's tokens (ttbundle's runner, ``PromptPositions.chunk``); None: the
        cache positions. KV slots always come from the cache positions. ``read_from_device``: the
        emulated mesh computes in the call either way; its result is its own handle
        (:meth:`read_prefill_output`)."""
        N, S = tokens.shape
        if N != 1:
            if (mm is not None or pixel_values is not None or return_prompt_logits or rope_positions is not None
                    or image_grid_thw is not None):
                raise ValueError("a packed prefill (several sequences in one call) takes text chunks only; "
                                 "prefill a request with images, M-RoPE positions or prompt logits alone")
            return self.prefill_packed(tokens, page_table, kv_cache, prompt_lens, start_pos, sampling_params)
        if S not in self.prefill_buckets:
            raise ValueError(f"prefill runs one sequence padded to a bucket {self.prefill_buckets}, "
                             f"got tokens {list(tokens.shape)}")
        program = self._program("prefill", S)
        n = int(prompt_lens[0])
        p0 = 0 if start_pos is None else int(start_pos[0])
        deltas = None
        if mm is None and pixel_values is not None:
            px = request_pixels(pixel_values, N, p0)
            thw = image_grid_thw[0] if isinstance(image_grid_thw, (list, tuple)) else image_grid_thw
            if self.model.vision_part is None:
                raise ValueError(f"pixel_values for {self.package.name}, a text-only model (no vision part)")
            mm, pos = prompt_inputs(self.model.vision_part, tokens[0, :n].tolist(), px, thw, self.encode_images, S)
            if not pos.plain and rope_positions is None:  # M-RoPE: the positions the images give
                rope_positions = pos.chunk(0, n, S)["rope_positions"]
                deltas = torch.tensor([pos.delta], dtype=torch.long)
        valid = torch.arange(S)[None, :] < n
        positions = torch.where(valid, torch.arange(p0, p0 + S)[None, :], torch.zeros(1, S, dtype=torch.long))
        if return_prompt_logits:
            logits = self.model.forward(program, tokens, positions, valid, page_table, kv_cache, mm=mm,
                                        rope_positions=rope_positions)
            return logits[0, :n].float()
        logits = self.model.forward(program, tokens, positions, valid, page_table, kv_cache, mm=mm,
                                    rope_positions=rope_positions, last=[n - 1])
        out = self._finish(logits[:, 0], sampling_params)
        return out if deltas is None else (out, deltas)

    @torch.no_grad()
    def prefill_packed(self, tokens: torch.Tensor, page_table: torch.Tensor, kv_cache: KVCache, prompt_lens,
                       start_pos=None, sampling_params: DeviceSampling | None = None):
        """Several sequences' prefill chunks in one call of one prefill program: ``tokens``
        [N, R], N sequences of R rows each, N * R a prefill bucket (the program's rows;
        ``runtime.phases.pack_prefill`` plans it), R a multiple of the tile height, N at most
        one tile (the head's rows). Sequence ``i`` has its first ``prompt_lens[i]`` rows real,
        at positions from ``start_pos[i]``, and its own page table row; ``prompt_lens[i] == 0``
        is an empty sequence (nothing written, its output ignored). Each sequence attends to its
        own context only (the attention kernel's per-sequence paged context, as in decode).
        Returns each sequence's last real token's logits [N, V] or sampled ids [N]."""
        N, R = tokens.shape
        S = N * R
        lens = torch.as_tensor(list(prompt_lens), dtype=torch.long)
        starts = torch.zeros(N, dtype=torch.long) if start_pos is None else torch.as_tensor(list(start_pos),
                                                                                             dtype=torch.long)
        if S not in self.prefill_buckets or R % TILE or N > TILE or len(lens) != N or bool((lens > R).any()):
            raise ValueError(f"a packed prefill runs N sequences of R rows (R a multiple of {TILE}, N <= {TILE}) "
                             f"filling a prefill bucket {self.prefill_buckets}, got tokens {list(tokens.shape)} "
                             f"with prompt_lens {lens.tolist()}")
        program = self._program("prefill", S)
        ar = torch.arange(R)[None, :]
        valid = ar < lens[:, None]
        positions = torch.where(valid, starts[:, None] + ar, torch.zeros(N, R, dtype=torch.long))
        logits = self.model.forward(program, tokens, positions, valid, page_table, kv_cache,
                                    last=(lens - 1).clamp(min=0))
        return self._finish(logits[:, 0], sampling_params)

    @property
    def vision_buckets(self) -> list[int]:
        return sorted(b for ph, b in self.model.programs if ph == "vision")

    @torch.no_grad()
    def encode_images(self, pixel_values: torch.Tensor, image_grid_thw=None) -> torch.Tensor:
        """Soft tokens [soft tokens, hidden] of the images vLLM's processor made (Gemma 3:
        ``pixel_values`` [images, C, H, W]; Qwen2.5-VL: [patches, C x T x P x P] with
        ``image_grid_thw`` [images, 3]): the vision program of the smallest bucket holding them
        (what a bucket counts is the family's vision part's ``bucket_need``)."""
        bucket, _ = vision_bucket(self.model.vision_part, self.vision_buckets, pixel_values, image_grid_thw)
        self._program("vision", bucket)
        return self.model.encode_images(pixel_values, image_grid_thw)

    @torch.no_grad()
    def decode_forward(self, tokens: torch.Tensor, start_pos: torch.Tensor, page_table: torch.Tensor,
                       kv_cache: KVCache, sampling_params: DeviceSampling | None = None,
                       enable_trace: bool = True, read_from_device: bool = True, prev_output=None,
                       prev_rows: torch.Tensor | None = None, rope_positions: torch.Tensor | None = None,
                       rope_deltas=None):
        """One decode step. ``tokens`` [B, 1] with B a decode bucket; ``start_pos`` [B] is each
        row's position, -1 for padding rows. Returns logits [B, V] or sampled ids [B].
        Async decode: ``read_from_device=False`` returns the step's output handle (read with
        :meth:`read_decode_output`); a row ``i`` with ``prev_rows[i] >= 0`` takes its input token
        from row ``prev_rows[i]`` of ``prev_output``, an earlier step's unread sampled ids (on the
        emulated mesh the handle already holds them: the step ran at submit). ``rope_positions``
        [3, B, 1]: M-RoPE positions (a row at cache position p of a prompt with M-RoPE delta d:
        p + d in all three rows); None: the cache positions. ``rope_deltas`` [B] (what
        ``prefill_forward`` returned per request, Tenstorrent's convention; 0 for text-only rows)
        gives the same: row ``i`` at ``start_pos[i] + rope_deltas[i]``."""
        if prev_rows is not None:
            take = prev_rows >= 0
            tokens = torch.where(take[:, None], prev_output[prev_rows.clamp(min=0)].long()[:, None], tokens)
        B = tokens.shape[0]
        if tokens.shape[1] != 1 or B not in self.decode_buckets:
            raise ValueError(f"decode runs a batch padded to a bucket {self.decode_buckets}, "
                             f"got tokens {list(tokens.shape)}")
        program = self._program("decode", B)
        valid = (start_pos >= 0)[:, None]
        positions = start_pos.clamp(min=0)[:, None]
        if rope_positions is None and rope_deltas is not None:
            d = torch.as_tensor(rope_deltas, dtype=torch.long).reshape(-1)
            rope_positions = decode_rope(start_pos, torch.nn.functional.pad(d, (0, B - d.numel())))
        logits = self.model.forward(program, tokens, positions, valid, page_table, kv_cache,
                                    rope_positions=rope_positions)
        return self._finish(logits[:, 0], sampling_params)

    @torch.no_grad()
    def verify_forward(self, tokens: torch.Tensor, start_pos: torch.Tensor, num_tokens: torch.Tensor,
                       page_table: torch.Tensor, kv_cache: KVCache, sampling_params: DeviceSampling | None = None):
        """Speculative decoding's verify step (the package's ``verify`` program of a decode
        bucket). ``tokens`` [B, k + 1], B a decode bucket: row ``i`` holds its sequence's last
        token, then its proposals (a negative id: a proposal vLLM voided, never accepted);
        ``start_pos`` [B] the last token's position (-1: a padding row), ``num_tokens`` [B] the
        real rows (1 + proposals). Every row writes its KV slot; a rejected row's slot is
        rewritten by the next step (later positions are masked until then). Returns logits
        [B, k + 1, V] (host sampling) or, with ``sampling_params``, the accepted tokens
        [B, k + 1], -1 past each sequence's last (``sampling.accept``)."""
        valid, positions, n = verify_batch(self.package.serving.rows_per_seq, self.decode_buckets, tokens, start_pos, num_tokens)
        program = self._program("verify", tokens.shape[0])
        logits = self.model.forward(program, tokens.clamp(min=0), positions, valid, page_table, kv_cache)
        if sampling_params is None:
            return logits.float()
        return accept(logits, tokens[:, 1:], (n - 1).clamp(min=0), sampling_params)

    # -- warm-up --------------------------------------------------------------------------------
    def _null_table(self, rows: int, kv_cache: KVCache, seq: int) -> torch.Tensor:
        # every position maps to block 0, vLLM's null block: never handed to a request
        return torch.zeros(rows, blocks_per_seq(seq, kv_cache.block_size), dtype=torch.long)

    #: rows of the short input each program runs at warm-up (the emulated mesh has nothing to
    #: compile or capture; the programs accept any row count with their features)
    WARMUP_PREFILL_ROWS = 32
    WARMUP_DECODE_ROWS = 4

    def _warm(self, phase: str, bucket: int, n: int, kv_cache: KVCache, can_sample_on_device: bool):
        """Program (phase, bucket) once on the real rows of a short input (``n`` tokens of one
        sequence, or ``n`` decode rows), all in vLLM's null block, its logits sampled on the host
        path and, if enabled, the device path."""
        program = self._program(phase, bucket)
        if phase == "prefill":
            tokens, positions = torch.zeros(1, n, dtype=torch.long), torch.arange(n)[None, :]
            pt, last = self._null_table(1, kv_cache, n), [n - 1]
        elif phase == "verify":  # n sequences of k + 1 rows
            K1 = self.package.serving.rows_per_seq
            tokens, positions = torch.zeros(n, K1, dtype=torch.long), torch.arange(K1).repeat(n, 1)
            pt, last = self._null_table(n, kv_cache, K1), None
        else:
            tokens, positions = torch.zeros(n, 1, dtype=torch.long), torch.zeros(n, 1, dtype=torch.long)
            pt, last = self._null_table(n, kv_cache, 1), None
        with torch.no_grad():
            logits = self.model.forward(program, tokens, positions, positions >= 0, pt, kv_cache, last=last)[:, 0]
        self._finish(logits, None)
        if can_sample_on_device and phase == "verify":
            with torch.no_grad():
                full = self.model.forward(program, tokens, positions, positions >= 0, pt, kv_cache)
            accept(full, tokens[:, 1:], torch.full((n,), tokens.shape[1] - 1),
                   DeviceSampling.from_params([], [], n))
        elif can_sample_on_device:
            self._finish(logits, DeviceSampling.from_params([], [], logits.shape[0]))
        self.warmed.add((phase, bucket))

    def warmup_model_prefill(self, kv_cache: KVCache, enable_trace: bool = True,
                             can_sample_on_device: bool = True):
        """Every prefill program once (:meth:`_warm`: the real rows of a short input; logits and,
        if enabled, device sampling), and every vision bucket's encoder filled with fixed pixels."""
        for i, S in enumerate(self.prefill_buckets):
            t0 = time.perf_counter()
            self._warm("prefill", S, min(S, self.WARMUP_PREFILL_ROWS), kv_cache, can_sample_on_device)
            logger.info("[WARMUP] (%d/%d) prefill %d tokens: %.2f s", i + 1, len(self.prefill_buckets),
                        S, time.perf_counter() - t0)
        part = self.model.vision_part
        for n in self.vision_buckets:  # the vision encoder on fixed pixels filling each bucket
            t0 = time.perf_counter()
            x = part.warmup_inputs(self.bundle.vision, n)
            self.encode_images(x["pixel_values"], x.get("image_grid_thw"))
            self.warmed.add(("vision", n))
            logger.info("[WARMUP] vision %d %s: %.2f s", n, part.BUCKET_UNIT, time.perf_counter() - t0)

    def warmup_model_decode(self, kv_cache: KVCache, enable_trace: bool = True, max_batch_size=None,
                            num_blocks=None, can_sample_on_device: bool = True):
        """Every decode program once (:meth:`_warm`), and every verify program (speculative
        decoding) the package has."""
        for i, B in enumerate(self.decode_buckets):
            t0 = time.perf_counter()
            self._warm("decode", B, min(B, self.WARMUP_DECODE_ROWS), kv_cache, can_sample_on_device)
            logger.info("[WARMUP] (%d/%d) decode batch %d: %.2f s", i + 1, len(self.decode_buckets),
                        B, time.perf_counter() - t0)
        for B in sorted(b for ph, b in self.model.programs if ph == "verify"):
            t0 = time.perf_counter()
            self._warm("verify", B, min(B, self.WARMUP_DECODE_ROWS), kv_cache, can_sample_on_device)
            logger.info("[WARMUP] verify batch %d: %.2f s", B, time.perf_counter() - t0)

    def seal(self):
        """From now on only warmed-up shapes run (no capture while serving)."""
        self.sealed = True

    def release(self) -> None:
        """Nothing held outside this process's memory: the emulated mesh has no device to free."""

    # -- embeddings (``task: embed``: runtime.pooling, the emulated mesh only) ----------------------
    @torch.no_grad()
    def prefill_hidden(self, tokens: torch.Tensor, page_table: torch.Tensor, kv_cache: KVCache, n: int,
                       start: int) -> torch.Tensor:
        """A prefill chunk's final hidden states [n, hidden] (float32, after the final norm):
        ``tokens`` [1, bucket] (the first ``n`` real) run at positions ``start..`` as the bucket's
        prefill program runs them for generation (KV written)."""
        bucket = tokens.shape[1]
        valid = torch.arange(bucket)[None, :] < n
        positions = torch.where(valid, torch.arange(start, start + bucket)[None, :],
                                torch.zeros(1, bucket, dtype=torch.long))
        h = self.model.final_hidden(self._program("prefill", bucket), tokens, positions, valid, page_table,
                                    kv_cache, n - 1)
        return h[:n].float()

    # -- Tenstorrent's decode read-back (the emulated mesh's outputs are host tensors already) ------
    def read_prefill_output(self, handle):
        return handle

    def read_decode_output(self, tt_out, async_read: bool = True):
        return tt_out

    def process_decode_output_host(self, tt_out, is_tokens: bool | None = None):
        return tt_out


def _on_device(pkg, hf_config, mesh_device, max_batch_size, max_seq_len, tt_data_parallel, optimizations,
               trace_mode):
    """The package on a ttnn mesh device (Tenstorrent's plugin calling the generated adapter)."""
    got = tuple(mesh_device.shape) if hasattr(mesh_device, "shape") else None
    if got is not None and got != tuple(pkg.loaded.mesh.shape):
        raise ValueError(f"{pkg.name}: built for {pkg.loaded.mesh.describe()}, handed a "
                         f"{got[0]}x{got[1]} mesh device; serve the package built for that mesh")
    opts = TTOptions(trace_mode=trace_mode, optimizations=optimizations)
    return TTDeviceModel.initialize_vllm_model(
        hf_config, mesh_device, max_batch_size, max_seq_len, tt_data_parallel, optimizations, package=pkg,
        options=opts, sample_mode=opts.sample_mode(pkg.serving.sample_on_device_mode))
