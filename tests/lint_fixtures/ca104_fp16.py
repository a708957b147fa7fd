"""CA104: float16 where gradients are measured (lines 7, 13, 19-21 are flagged)."""
import torch
from torch.cuda.amp import autocast


def gradients_under_autocast(model, x, y):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = (model(x) - y).pow(2).mean()
    return torch.autograd.grad(loss, list(model.parameters()))


def gradients_under_cuda_amp(model, x):
    with autocast():  # float16 by default
        out = model(x)
    out.sum().backward()


def gradients_of_a_half_model(model, x):
    model = model.half()
    x = x.to(torch.float16)
    x = x.to(dtype=torch.half)
    model(x).sum().backward()
    return [p.grad for p in model.parameters()]
