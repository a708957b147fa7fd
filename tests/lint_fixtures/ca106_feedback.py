"""CA106: feedback matrices drawn without a seeded generator, or never saved.

Flagged: line 16 (unseeded and never saved), line 17 (unseeded; a Parameter is saved),
line 22 (seeded but never saved), line 27 (unseeded; saved by np.save),
line 33 (unseeded and never saved).
"""
import numpy as np
import torch
from torch import nn


class FeedbackAlignment(nn.Module):
    def __init__(self, d: int, k: int):
        super().__init__()
        self.W = nn.Linear(d, k)
        self.B = torch.randn(k, d)
        self.feedback = nn.Parameter(torch.rand(k, d), requires_grad=False)


def dfa_feedback(widths, k, seed):
    g = torch.Generator().manual_seed(seed)
    Bs = [torch.randn(k, w, generator=g) for w in widths]
    return Bs


def numpy_feedback(d, k):
    B_np = np.random.randn(k, d)
    np.save("feedback.npy", B_np)
    return B_np


def tied_feedback(k, d):
    fb = torch.empty(k, d).normal_(0.0, 0.1)
    return fb
