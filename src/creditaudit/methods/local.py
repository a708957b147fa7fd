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

from ..model.members import MemberNet, member_cross_entropy
from .base import Method


def output_error(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """e = softmax(logits) − onehot(y), (N, C)."""
    return logits.softmax(-1) - F.one_hot(y, logits.shape[-1]).to(logits.dtype)


def rms_normalise(a: torch.Tensor, eps: float = 1e-6, batch_dims: int = 1) -> torch.Tensor:
    """a / (rms(a) + eps), per sample over all its features; the first `batch_dims` dims index
    samples ((N,) for a lone run, (K, N) on the member axis)."""
    rms = a.pow(2).flatten(batch_dims).mean(-1).sqrt()
    return a / (rms.view(rms.shape + (1,) * (a.dim() - batch_dims)) + eps)


def sample_dot(f: torch.Tensor, a: torch.Tensor, batch_dims: int = 1) -> torch.Tensor:
    """⟨f_i, a_i⟩ per sample over all features, (N,) (or (K, N) with batch_dims=2)."""
    return (f * a).flatten(batch_dims).sum(-1)


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

        Each block sees its input detached, h_{l+1} = h_l + f_l(h_l) with h_l.detach() (f_l(h_l)
        alone without a skip, `model.advance`), so the
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
                h = self.model.advance(h, f.detach())
            else:
                with torch.no_grad():
                    h = self.model.advance(h, block(h))
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
        ce = self.model.loss(fwd.logits, y)
        total = ce + sample_dot(fwd.h0, a[0]).mean()
        for l, f in fwd.branches.items():
            total = total + sample_dot(f, a[l + 1]).mean()
            if lam:
                total = total + lam * f.pow(2).flatten(1).sum(-1).mean()
        total.backward()
        clip_blocks([self.block_params(l) for l in fwd.branches], self.settings.clip)
        return ce.detach()

    # -- the same step over a leading member axis ------------------------------------------------
    @staticmethod
    def member_local_forward(net: MemberNet, x: torch.Tensor, trained: tuple[int, ...]) -> LocalForward:
        """`local_forward` of K members at once (x (K, B, …)): a block that some member trains
        (`trained`) keeps its graph — the members that do not train it weigh its local loss by 0
        in `member_local_gradients` — and a block that no member trains runs without one."""
        h0 = net.embed_input(x)
        h = h0.detach()
        hidden, branches = [h], {}
        for l in range(net.n_blocks):
            if l in trained:
                f = net.block(l, h)
                branches[l] = f
                h = h + f.detach()
            else:
                with torch.no_grad():
                    h = h + net.block(l, h)
            hidden.append(h)
        return LocalForward(net.readout(h), hidden, h0, branches)

    def member_local_gradients(self, net: MemberNet, y: torch.Tensor, fwd: LocalForward,
                               credit: list[torch.Tensor], trains: torch.Tensor,
                               lam: float = 0.0) -> torch.Tensor:
        """`local_gradients` per member: J = Σ_k J_k with J_k member k's objective (its CE,
        its embedding term, and the local loss of each block it trains, weighted by trains[k, l]
        ∈ {0, 1}); members share no parameter, so one backward of J gives each member exactly
        its own gradient. Then each member's block gradient is clipped on its own norm
        (`clip_members`). Returns the members' CEs (K,)."""
        a = [t.detach() for t in credit]
        ce = member_cross_entropy(fwd.logits, y)
        total = ce.sum() + sample_dot(fwd.h0, a[0], 2).mean(1).sum()
        for l, f in fwd.branches.items():
            local = sample_dot(f, a[l + 1], 2).mean(1)
            if lam:
                local = local + lam * f.pow(2).flatten(2).sum(-1).mean(1)
            total = total + (local * trains[:, l].to(local.dtype)).sum()
        total.backward()
        for l in fwd.branches:
            clip_members(net.block_params(l), self.settings.clip)
        return ce.detach()


def input_credit(model, x: torch.Tensor, a1: torch.Tensor) -> torch.Tensor:
    """a_0 on a network whose h_0 is the input itself (the plain MLP: no embedding, nothing to
    train with a_0): ∂f_0(h_0)ᵀ a_1, of the input's shape — what block 0's local loss
    (f_0(h_0) · a_1) sends back to its input, and, for ep and pc, exactly the force on the clamped
    h_0 = x. Detached; the model's mode (dropout) as it is."""
    with torch.enable_grad():
        h0 = model.embed_input(x).detach().requires_grad_(True)
        (a0,) = torch.autograd.grad(model.blocks[0](h0), h0, a1.detach())
    return a0.detach()


def clip_blocks(blocks: list[list[torch.Tensor]], clip: float) -> None:
    """`torch.nn.utils.clip_grad_norm_(params, clip)` for each block's parameter list, with the
    same arithmetic (per-tensor norms, their norm, coef = min(1, clip / (‖g‖ + 1e-6)), g ← g·coef)
    but one foreach norm and one foreach multiply for all blocks: the per-call overhead of L
    separate clips was ~0.1 of a BP step on the CPU."""
    grads = [[p.grad for p in params if p.grad is not None] for params in blocks]
    flat = [g for block in grads for g in block]
    if not flat:
        return
    norms, coefs, start = torch._foreach_norm(flat, 2.0), [], 0
    for block in grads:
        if block:
            total = torch.linalg.vector_norm(torch.stack(norms[start:start + len(block)]), 2.0)
            coefs += [torch.clamp(clip / (total + 1e-6), max=1.0)] * len(block)
            start += len(block)
    torch._foreach_mul_(flat, coefs)


def clip_members(params: list[torch.Tensor], clip: float) -> None:
    """`torch.nn.utils.clip_grad_norm_(member k's slices, clip)` for every member k at once:
    g_k ← g_k · min(1, clip / (‖g_k‖ + 1e-6)) with ‖g_k‖ the norm over all of member k's slices."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    total = torch.stack([g.flatten(1).norm(dim=1) for g in grads], dim=1).norm(dim=1)   # (K,)
    coef = torch.clamp(clip / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.view((-1,) + (1,) * (g.dim() - 1)))
