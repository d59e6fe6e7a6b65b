"""Emulated mesh backend: per-device shards and explicit collectives in torch.

``model`` (:class:`EmulatedModel`: a package's programs run on its shards), ``runner``
(:class:`Runner`: prefill and decode padded to the buckets), ``state`` (the paged KV cache,
:class:`Stages`: a call run a stage at a time), ``lazy`` (:class:`LazyWeights`: weights read
on demand), the kernels, collectives (``meshops``) and replication classes they use."""

from .lazy import LazyWeights
from .model import EmulatedModel
from .runner import Runner
from .state import Stages

__all__ = ["EmulatedModel", "LazyWeights", "Runner", "Stages"]
