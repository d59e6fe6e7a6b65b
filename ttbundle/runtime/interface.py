"""The one model protocol: what the model runner (and Tenstorrent's plugin) calls on a package's
model, whichever mesh runs it.

Two models implement it and declare so (they subclass :class:`MeshModel`):
``adapter.BundleModel`` (the emulated mesh; every package's generated adapter subclasses it)
and ``ttdevice.TTDeviceModel`` (a ttnn mesh device). The methods are Tenstorrent's model
interface (tt-metal's ``models/tt_transformers/tt/generator_vllm.py``: ``initialize_vllm_model``,
``allocate_kv_cache``, ``prefill_forward``, ``decode_forward``, ``read_decode_output``,
``process_decode_output_host``, ``warmup_model_prefill`` / ``warmup_model_decode``) with
ttbundle's additions: ``seal`` (no capture while serving), ``encode_images`` and
``vision_buckets`` (a multimodal package's vision programs), ``model_capabilities`` and
``seeded_on_device``. Every method is abstract: a model that leaves one out cannot be built.
The runner is typed against this class and calls these names only; a
keyword a model cannot honour is refused by that model (a ``ValueError`` saying what runs where),
never probed for. ``tests/test_model_protocol.py`` checks both models have every member with the
protocol's parameters (names, kinds, defaults).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, Protocol

import torch


class MeshModel(Protocol):
    """A package's model on a mesh. Tensors are host torch tensors; ``kv_cache`` is what
    :meth:`allocate_kv_cache` returned; ``sampling_params`` is a ``runtime.sampling.DeviceSampling``
    (sample on the device: the call returns token ids) or None (return logits)."""

    #: what the model does (``runtime.capabilities.model_capabilities``; the runner reads
    #: ``max_top_k``, Tenstorrent's plugin the rest)
    model_capabilities: dict
    #: whether a request with its own seed can sample on the device (False: ``ttnn.sampling``
    #: takes one seed per batch, so the runner samples seeded rows on the host)
    seeded_on_device: bool

    @classmethod
    @abstractmethod
    def initialize_vllm_model(cls, hf_config, mesh_device, max_batch_size: int, max_seq_len: int,
                              tt_data_parallel: int = 1, optimizations=None, *, package=None) -> "MeshModel":
        """The model of ``package`` (a ``runtime.packages.Package``; None: the directory vLLM was
        given) on ``mesh_device``. A model's own keywords (the emulated mesh's ``dtype``, the
        device's ``options``) have defaults: Tenstorrent's plugin passes none of them."""
        ...

    @abstractmethod
    def allocate_kv_cache(self, kv_cache_shape, dtype=None, num_layers=None) -> Any:
        """The paged KV cache: ``kv_cache_shape`` (num_blocks, kv heads, block size, head dim)."""
        ...

    @abstractmethod
    def prefill_forward(self, tokens: torch.Tensor, page_table: torch.Tensor, kv_cache, prompt_lens,
                        start_pos=None, sampling_params=None, enable_trace: bool = True,
                        return_prompt_logits: bool = False, mm: dict | None = None, pixel_values=None,
                        rope_positions: torch.Tensor | None = None, image_grid_thw=None,
                        read_from_device: bool = True, **kwargs):
        """A prefill chunk: ``tokens`` [N, S] (one sequence, or N packed), the last real token's
        logits [N, V] or sampled ids [N]; ``return_prompt_logits``: every real position's logits;
        ``mm``: the chunk's image soft tokens; ``pixel_values`` / ``image_grid_thw``: a request's
        images as Tenstorrent's plugin passes them; ``rope_positions``: M-RoPE positions.
        ``read_from_device=False`` (ttbundle's runner): the chunk is enqueued and a handle comes
        back for :meth:`read_prefill_output`, so a step's chunks on different lanes (submeshes)
        run side by side."""
        ...

    @abstractmethod
    def read_prefill_output(self, handle):
        """What :meth:`prefill_forward` returns, for a chunk enqueued with ``read_from_device=False``."""
        ...

    @abstractmethod
    def decode_forward(self, tokens: torch.Tensor, start_pos: torch.Tensor, page_table: torch.Tensor,
                       kv_cache, sampling_params=None, enable_trace: bool = True,
                       read_from_device: bool = True, prev_output=None, prev_rows: torch.Tensor | None = None,
                       rope_positions: torch.Tensor | None = None, rope_deltas=None):
        """A decode step of a batch padded to a decode bucket: logits [B, V] or ids [B];
        ``read_from_device=False`` returns a handle for :meth:`read_decode_output` (async decode;
        ``prev_output`` / ``prev_rows``: input tokens taken from an unread earlier step)."""
        ...

    @abstractmethod
    def verify_forward(self, tokens: torch.Tensor, start_pos: torch.Tensor, num_tokens: torch.Tensor,
                       page_table: torch.Tensor, kv_cache, sampling_params=None):
        """Speculative decoding's verify step: ``tokens`` [B, k + 1] (each sequence's last token
        and its proposals), B a decode bucket; logits [B, k + 1, V], or with ``sampling_params``
        the accepted tokens [B, k + 1] (-1 past each sequence's last)."""
        ...

    @abstractmethod
    def read_decode_output(self, tt_out, async_read: bool = True):
        """A submitted decode's output, read back to the host."""
        ...

    @abstractmethod
    def process_decode_output_host(self, tt_out, is_tokens: bool | None = None) -> torch.Tensor:
        """Token ids [B] or logits [B, V] of a read-back decode output."""
        ...

    @property
    @abstractmethod
    def vision_buckets(self) -> list[int]:
        """The package's vision buckets ([] for a text model)."""
        ...

    @abstractmethod
    def encode_images(self, pixel_values: torch.Tensor, image_grid_thw=None) -> torch.Tensor:
        """Soft tokens [soft tokens, hidden] of images (the vision program of their bucket)."""
        ...

    @abstractmethod
    def warmup_model_prefill(self, kv_cache, enable_trace: bool = True, can_sample_on_device: bool = True):
        """Every prefill (and vision) program once."""
        ...

    @abstractmethod
    def warmup_model_decode(self, kv_cache, enable_trace: bool = True, max_batch_size=None, num_blocks=None,
                            can_sample_on_device: bool = True):
        """Every decode program once."""
        ...

    @abstractmethod
    def seal(self) -> None:
        """After warm-up: from now on only warmed shapes run (a device captures its traces)."""
        ...

    @abstractmethod
    def release(self) -> None:
        """Before the mesh closes (the worker's shutdown): give back what the model holds on it
        (a device's traces); nothing to do on the emulated mesh."""
        ...

