"""A loaded spec (:class:`Bundle`) and where its keys are in the file (``locate``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import Diagnostic, InvalidInput
from .schema import Buckets, BundleSpec, Embedding, Vision
from .. import hub


@dataclass
class Bundle:
    """A loaded spec plus everything derived from it that later stages need."""

    spec: BundleSpec
    arch: object  # the family's ArchBase subclass instance
    family: object  # families.base.Family
    file: str
    base_dir: Path
    positions: dict = field(default_factory=dict)
    warnings: list[Diagnostic] = field(default_factory=list)

    @property
    def buckets(self) -> Buckets:
        bk = self.spec.buckets or Buckets(**self.family.default_buckets(self.arch))
        if self.spec.task == "embed":  # prefill programs only (``embed.check`` refuses decode buckets)
            bk = bk.model_copy(update={"decode": []})
        return bk

    @property
    def embedding(self) -> Embedding | None:
        """The pooling of a ``task: embed`` bundle (the spec's or the default), else None."""
        return (self.spec.embedding or Embedding()) if self.spec.task == "embed" else None

    @property
    def vision(self) -> Vision | None:
        """The image settings of a model with a vision part (the spec's or the default), else None."""
        if getattr(self.arch, "vision", None) is None:
            return None
        return self.family.vision_part(self.arch).settings(self.spec.vision or Vision())

    def locate(self, path: tuple, message: str, severity: str = "error") -> Diagnostic:
        return locate(self.file, self.positions, path, message, severity)

    def tokenizer_dir(self) -> Path | None:
        """The tokenizer's directory: `tokenizer:`, else from_hf's directory, else the weights
        directory (None: `tokenizer: false`, or none of them given)."""
        s = self.spec
        if s.tokenizer is False:  # token ids only
            return None
        for p in (s.tokenizer, s.from_hf, s.weights.source):
            if p is not None:
                d = self.resolve_path(p)
                return d if d.is_dir() else d.parent
        return None

    def resolve_path(self, p: str | None, download: bool = True) -> Path | None:
        """A spec path (``from_hf``, ``weights.source``, ``tokenizer``): relative to the spec's
        directory, or a model id ``ORG/NAME[@REVISION]`` in the Hugging Face cache (``hub.resolve``)."""
        return None if p is None else hub.resolve(p, self.base_dir, download).path


class InvalidSpec(InvalidInput):
    """A spec that passed the schema but broke other rules; ``bundle`` lets callers add the
    per-mesh checks so every problem is reported at once."""

    def __init__(self, message: str, diagnostics: list[Diagnostic], bundle: Bundle):
        super().__init__(message, diagnostics)
        self.bundle = bundle


def locate(file, positions, path, message, severity="error") -> Diagnostic:
    """A diagnostic at ``path``, or at its nearest ancestor that exists in the file."""
    p = tuple(path)
    while p and p not in positions:
        p = p[:-1]
    line, col = positions.get(p, (None, None))
    return Diagnostic(message, ".".join(map(str, path)), file, line, col, severity)
