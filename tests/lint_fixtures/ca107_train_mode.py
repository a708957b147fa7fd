"""CA107: measurements taken with Dropout/BatchNorm in train mode (lines 16 and 21 are flagged)."""
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1), nn.Linear(8, 2))

    def forward(self, x):
        return self.body(x)


def gradient_alignment(model, x, y):
    model.train()
    loss = nn.functional.cross_entropy(model(x), y)
    return torch.autograd.grad(loss, list(model.parameters()))


def evaluate(model, x, y):
    return (model(x).argmax(-1) == y).float().mean()
