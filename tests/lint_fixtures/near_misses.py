"""Patterns close to each rule that are correct: `creditaudit lint` must stay silent here.

(The names F.cosine_similarity and torch.load(..., weights_only=False) in this docstring, and
`x.norm(-1)` in a comment, are text, not code.)
"""
import numpy as np
import torch
from torch import nn
from safetensors.torch import save_file


# CA101: dim by keyword, p positional, a LayerNorm held as `self.norm`.
def norms(x, h, layer):
    a = x.norm(dim=-1)
    b = x.norm(p=2, dim=-1)
    c = x.norm()
    d = x.norm(1)  # the L1 norm of the whole tensor, on purpose
    e = torch.linalg.vector_norm(x, dim=-1)
    f = np.linalg.norm(x, 2, -1)  # numpy's positional axis is its documented API
    g = layer.norm(h)
    return a, b, c, d, e, f, g


# CA102 / CA103: cosines without a clamp, or floored far below any gradient norm.
def gradient_cosine(a, g):
    dot = (a * g).sum(-1)
    den = a.norm(dim=-1) * g.norm(dim=-1)
    exact = dot / den
    exact = torch.where(den > 0, exact, torch.full_like(exact, float("nan")))
    tiny = dot / (a.norm(dim=-1) * g.norm(dim=-1)).clamp(min=1e-30)
    tiny_sum = dot / (a.norm(dim=-1) * g.norm(dim=-1) + 1e-30)
    log_probs = torch.softmax(a, -1).clamp(min=1e-8).log()  # a clamp, but no norm divided by
    standardised = a / (a.std() + 1e-5)  # a floor, but not of a norm
    clipped = a / max(1.0, a.norm().item())  # a clipping threshold, not an epsilon
    cos_exact = torch.nn.functional.cosine_similarity(a, g, eps=1e-30)
    return exact, tiny, tiny_sum, log_probs, standardised, clipped, cos_exact


# CA104: bfloat16, autocast on CPU (bf16 by default), and float16 where no gradient is taken.
def gradients_in_bf16(model, x):
    model.eval()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x).sum()
    loss.backward()
    with torch.autocast("cpu"):
        loss = model(x).sum()
    return torch.autograd.grad(loss, list(model.parameters()))


def predict_in_half(model, x):
    return model.half()(x.half())


def amp_training_step(model, opt, scaler, x):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(x).sum()
    scaler.scale(loss).backward()  # loss scaling: not a gradient measurement
    scaler.step(opt)


# CA105
def load(path):
    return torch.load(path, weights_only=True)


# CA106: seeded feedback that is saved, and random tensors that are not feedback.
class FeedbackAlignment(nn.Module):
    def __init__(self, d, k, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.register_buffer("B", torch.randn(k, d, generator=g))
        self.dropout = nn.Dropout(0.1)
        self.norm = nn.LayerNorm(d)


def numpy_feedback(d, k, seed, path):
    rng = np.random.default_rng(seed)
    B = rng.standard_normal((k, d))
    checkpoint = {"feedback": B}
    np.savez(path, **checkpoint)
    noise = torch.randn(k, d)  # not a feedback matrix
    return B, noise


def dfa_feedback(widths, k, seed, path):
    g = torch.Generator().manual_seed(seed)
    fb = [torch.randn(k, w, generator=g) for w in widths]
    save_file({f"fb{i}": b for i, b in enumerate(fb)}, path)
    return fb


# CA107: eval mode set here, or by the caller, or a training step (train mode on purpose).
def gradient_alignment(model, x, y):
    was_training = model.training
    model.eval()
    loss = nn.functional.cross_entropy(model(x), y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    model.train(was_training)
    return grads


def evaluate(model, x, y):
    return (model(x).argmax(-1) == y).float().mean()


def report(model, x, y):
    model.eval()
    return evaluate(model, x, y)


def train_step(model, x, y):
    model.train()
    loss = nn.functional.cross_entropy(model(x), y)
    return torch.autograd.grad(loss, list(model.parameters()))


def cosine(a, b):  # a metric name, but no model involved
    return (a * b).sum() / (a.norm() * b.norm())
