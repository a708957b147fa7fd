"""Suppression comments: line 7 and 8 are silenced; 9 keeps CA101, 10 keeps CA102, 11 is flagged."""
import torch
import torch.nn.functional as F


def gamma(a, g, x, path):
    c = F.cosine_similarity(a, g)  # creditaudit: ignore[CA102]
    s = torch.load(path, weights_only=False)  # creditaudit: ignore
    d = F.cosine_similarity(a, g) / x.norm(-1)  # creditaudit: ignore[CA102]
    e = F.cosine_similarity(a, g)  # creditaudit: ignore[CA101, CA105]
    f = F.cosine_similarity(a, g)
    return c, s, d, e, f
