"""CA103: a cosine denominator floored at eps >= 1e-12 (lines 10-14, 17, 20 are flagged)."""
import torch

EPS = 1e-8


def gradient_cosines(a: torch.Tensor, g: torch.Tensor):
    dot = (a * g).sum(-1)
    out = [
        dot / (a.norm(dim=-1) * g.norm(dim=-1)).clamp(min=1e-8),
        dot / (a.norm(dim=-1) * g.norm(dim=-1)).clamp_min(1e-6),
        dot / torch.clamp(a.norm(dim=-1) * g.norm(dim=-1), min=EPS),
        dot / max(a.norm() * g.norm(), 1e-8),
        dot / (torch.linalg.vector_norm(a, dim=-1) * g.norm(dim=-1) + 1e-12),
    ]
    na, ng = a.norm(dim=-1), g.norm(dim=-1)
    out.append(dot / (na * ng + EPS))
    # A floored denominator kept in a variable, then divided by.
    den = na * ng
    den = den.clamp(min=1e-8)
    out.append(dot / den)
    return out
