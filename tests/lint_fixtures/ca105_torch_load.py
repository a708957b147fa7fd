"""CA105: torch.load(..., weights_only=False) unpickles arbitrary code (line 6 is flagged)."""
import torch


def load_checkpoint(path):
    return torch.load(path, map_location="cpu", weights_only=False)
