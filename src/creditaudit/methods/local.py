"""The machinery shared by the local-credit methods (dfa, dfa-penalty, sb, cb).

A local method turns a credit signal a_0 … a_L into weight updates without backpropagating
through the stack:

    block l:   (f_l(h_l.detach()) · a_{l+1}).sum(-1).mean()   [+ λ · mean_i ‖f_l(h_l.detach())_i‖²]
    embed:     (embed(x) · a_0).sum(-1).mean()
    head:      CE(readout(h_L.detach()), y)

with a per-block gradient clip. `LocalMethod` gives its subclasses one forward that is at once the
model's forward and every local loss's graph, and one fused update. For a token or feature-map
stream the products sum over every feature of the sample (the dot product of the flattened
states).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .base import Method


def output_error(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """e = softmax(logits) − onehot(y), (N, C)."""
    return logits.softmax(-1) - F.one_hot(y, logits.shape[-1]).to(logits.dtype)


def rms_normalise(a: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """a / (rms(a) + eps), per sample over all its features."""
    rms = a.pow(2).flatten(1).mean(-1).sqrt().view((-1,) + (1,) * (a.dim() - 1))
    return a / (rms + eps)


def sample_dot(f: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """⟨f_i, a_i⟩ per sample over all features, (N,)."""
    return (f * a).flatten(1).sum(-1)


@dataclass
class LocalForward:
    """`Method.local_forward`'s result: logits (graph to the head only), h_0 … h_L (detached
    values), h_0 = embed(x) with its graph, and f_l(h_l.detach()) with graph per trainable block."""

    logits: torch.Tensor
    hidden: list[torch.Tensor]
    h0: torch.Tensor
    branches: dict[int, torch.Tensor]



class LocalMethod(Method):
    """A method whose blocks learn from a local loss on a credit signal (see the module docstring)."""

    def local_param_groups(self) -> list[dict[str, Any]]:
        """AdamW parameter groups of a local-credit method: embed, each trainable block, head."""
        return ([{"params": self.embed_params()}]
                + [{"params": self.block_params(l)} for l in range(self.model.n_blocks)
                   if self.trainable(l)]
                + [{"params": self.head_params()}])

    def local_forward(self, x: torch.Tensor) -> LocalForward:
        """One forward pass that is at once the model's forward and every local loss's graph.

        Each block sees its input detached, h_{l+1} = h_l + f_l(h_l) with h_l.detach(), so the
        values are exactly the model's forward, while the graph holds only the local pieces:
        embed(x) for the embedding, f_l(h_l.detach()) per trainable block, and the readout of
        h_L.detach() for the head. A local method thus pays for one forward per step, not two.
        """
        h0 = self.model.embed_input(x)
        return self.local_stack(h0, h0.detach())

    def local_stack(self, h0: torch.Tensor, h: torch.Tensor) -> LocalForward:
        """`local_forward` from a given state h at position 0 (detached; `local_forward` passes
        h0.detach(), PEPITA its modulated h_0), h0 = embed(x) keeping the embedding's graph."""
        hidden, branches = [h], {}
        for l, block in enumerate(self.model.blocks):
            if self.trainable(l):
                f = block(h)
                branches[l] = f
                h = h + f.detach()
            else:
                with torch.no_grad():
                    h = h + block(h)
            hidden.append(h)
        return LocalForward(self.model.readout(h), hidden, h0, branches)

    def local_gradients(self, y: torch.Tensor, fwd: LocalForward, credit: list[torch.Tensor],
                        lam: float = 0.0) -> torch.Tensor:
        """The gradients of one fused step of a local-credit method (dfa, dfa-penalty, sb, cb),
        given a_0 … a_L:

            J = CE(out_head(out_ln(h_L.detach())), y)                            out_ln, out_head
              + (embed(x) · a_0).sum(-1).mean()                                  embed
              + Σ_{l trainable} (f_l(h_l.detach()) · a_{l+1}).sum(-1).mean()    block l
                                + λ · mean_i ‖f_l(h_l.detach())_i‖²

        The parameter sets of the terms are disjoint, so ONE backward of J gives each part exactly
        the gradient of its own loss; then each trainable block's gradient is clipped to norm
        `settings.clip` (the optimizer step is `apply_gradients`). Returns the batch CE (detached).
        """
        a = [t.detach() for t in credit]
        ce = F.cross_entropy(fwd.logits, y)
        total = ce + sample_dot(fwd.h0, a[0]).mean()
        for l, f in fwd.branches.items():
            total = total + sample_dot(f, a[l + 1]).mean()
            if lam:
                total = total + lam * f.pow(2).flatten(1).sum(-1).mean()
        total.backward()
        for l in fwd.branches:
            torch.nn.utils.clip_grad_norm_(self.block_params(l), self.settings.clip)
        return ce.detach()
