"""CA102: cosine_similarity clamps its denominator at eps=1e-8 (lines 10-14 are flagged)."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.functional import cosine_similarity


def gradient_cosines(a: torch.Tensor, g: torch.Tensor):
    return [
        F.cosine_similarity(a, g, dim=-1),
        torch.nn.functional.cosine_similarity(a, g),
        torch.cosine_similarity(a, g),
        nn.CosineSimilarity(dim=-1)(a, g),
        cosine_similarity(a, g, eps=1e-8),
    ]
