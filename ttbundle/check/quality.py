"""Quality: the package's next-token distributions against the original checkpoint's, the way the
field reports a converted model (llama.cpp's ``--kl-divergence``, tt-transformers' teacher-forced
top-1/top-5 targets): teacher-forced top-1 and top-5 agreement, the KL divergence of the
package's distribution from the original's (mean, p99, p99.9) and the perplexity ratio on the
text's own next tokens. A statistical question about the storage, apart from whether the mesh
runs the package's numbers (the executor verdict)."""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from ..spec import DEFAULT_QUALITY

#: metrics where larger is better (the rest: smaller is better)
HIGHER_IS_BETTER = ("top1", "top5")


@dataclass
class Quality:
    """The figures over the compared positions (teacher-forced: both sides read the same text)."""

    positions: int
    top1: float  # share of positions whose package top-1 is the original's top-1
    top5: float  # share whose original top-1 is among the package's top 5
    kl_mean: float  # KL(original || package) per position, nats
    kl_p99: float
    kl_p999: float
    kl_max: float
    ppl_original: float  # perplexity of the text's next tokens (positions with one)
    ppl_package: float
    #: the storage the targets are for, the targets, and whether natural text was read
    storage: str = "bf16"
    targets: dict = field(default_factory=dict)
    natural_text: bool = True
    text: str = ""

    @property
    def ppl_ratio(self) -> float:
        return self.ppl_package / self.ppl_original if self.ppl_original else float("inf")

    def value(self, metric: str) -> float:
        return getattr(self, metric)

    def misses(self) -> list[str]:
        """Each target missed, in words (empty: all met, or not judged)."""
        if not self.natural_text:
            return []
        out = []
        for m, t in self.targets.items():
            v = self.value(m)
            bad = v < t if m in HIGHER_IS_BETTER else v > t
            if bad:
                out.append(f"{m} {v:.4g} {'<' if m in HIGHER_IS_BETTER else '>'} {t:g}")
        return out

    @property
    def judged(self) -> bool:
        return self.natural_text

    @property
    def passed(self) -> bool:
        return not self.misses()

    def to_json(self) -> dict:
        return {"judged": self.judged, "passed": self.passed, "natural_text": self.natural_text,
                "text": self.text, "storage": self.storage, "targets": self.targets,
                "positions": self.positions, "top1": self.top1, "top5": self.top5,
                "kl_mean": self.kl_mean, "kl_p99": self.kl_p99, "kl_p999": self.kl_p999,
                "kl_max": self.kl_max, "ppl_original": self.ppl_original,
                "ppl_package": self.ppl_package, "ppl_ratio": self.ppl_ratio, "misses": self.misses()}


def measure(original, package, next_tokens) -> dict:
    """The figures of :class:`Quality` from the original's and the package's logits
    ``[positions, vocab]`` and each position's next text token (-1: none)."""
    import torch

    lo, lp = original.double().log_softmax(-1), package.double().log_softmax(-1)
    kl = (lo.exp() * (lo - lp)).sum(-1).clamp(min=0)
    ref1 = original.argmax(-1)
    top5 = package.topk(min(5, package.shape[-1]), dim=-1).indices
    nt = torch.as_tensor(next_tokens, dtype=torch.long)
    has = nt >= 0
    idx = nt.clamp(min=0)[:, None]
    nll_o = -lo.gather(1, idx)[:, 0][has]
    nll_p = -lp.gather(1, idx)[:, 0][has]
    q = lambda p: float(torch.quantile(kl, p)) if len(kl) else 0.0  # noqa: E731
    return {"positions": len(kl), "top1": float((package.argmax(-1) == ref1).double().mean()),
            "top5": float((top5 == ref1[:, None]).any(-1).double().mean()),
            "kl_mean": float(kl.mean()), "kl_p99": q(0.99), "kl_p999": q(0.999), "kl_max": float(kl.max()),
            "ppl_original": float(nll_o.mean().exp()) if len(nll_o) else 0.0,
            "ppl_package": float(nll_p.mean().exp()) if len(nll_p) else 0.0}


def targets_for(bundle, storage: str) -> dict:
    """The spec's quality targets for ``storage`` (``quality.<storage>``: the metrics it sets),
    else ``spec.DEFAULT_QUALITY``'s."""
    declared = bundle.spec.quality
    t = None if declared is None else getattr(declared, storage)
    if t is None:
        return dict(DEFAULT_QUALITY[storage])
    return {k: v for k, v in t.model_dump().items() if v is not None}


def default_text() -> str:
    """The public-domain text shipped with ttbundle (``ttbundle/data/quality.txt``)."""
    return resources.files("ttbundle").joinpath("data", "quality.txt").read_text(encoding="utf-8")
