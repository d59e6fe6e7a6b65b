"""Emulated mesh backend: per-device shards and explicit collectives in torch."""

from .model import EmulatedModel, Runner, pick

__all__ = ["EmulatedModel", "Runner", "pick"]
