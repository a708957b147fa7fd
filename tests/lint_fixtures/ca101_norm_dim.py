"""CA101: a norm's dim passed positionally, or -1 read as p (lines 7-11 are flagged)."""
import torch


def per_sample_norms(x: torch.Tensor):
    # Each of these was meant as "the L2 norm of every row".
    a = x.norm(-1)  # p=-1 over the whole tensor: one scalar
    b = x.norm(2, -1)
    c = torch.norm(x, 2, -1)
    d = torch.linalg.norm(x, -1)
    e = torch.linalg.vector_norm(x, 2, -1)
    return a, b, c, d, e
