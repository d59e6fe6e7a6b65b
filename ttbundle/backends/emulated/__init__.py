"""Emulated mesh backend: per-device shards and explicit collectives in torch."""

from .model import EmulatedModel, LazyWeights, Runner, Stages, pick

__all__ = ["EmulatedModel", "LazyWeights", "Runner", "Stages", "pick"]
