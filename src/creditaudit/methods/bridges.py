"""sb / cb — the state-bridge and credit-bridge diagnostic probes (SPEC §5).

Both learn an auxiliary net that maps a residual state h_l (plus a learned depth embedding t_l and the
output error s = e, detached) to a credit a_l; the blocks then train with the local loss on it, the
embedding with a_0, the head with CE (`Method.local_update`, per-block clip at settings.clip);
option `lam` > 0 adds dfa-penalty's λ · mean_i ‖f_l(h_l)_i‖² to each block's local loss (the paper
reports SB/CB with λ = 1e-2, which the audit presets use; the default 0 is the unpenalised probe).
The credits are in per-sample units (∂ℓ_i/∂h with ℓ_i the sample's CE, no 1/N), so the local loss
(f_l · a_{l+1}).sum(-1).mean() has the BP weight gradient's scale when the probe is exact.

Aux nets (choices; SPEC is silent): input [LN(h_l), t_l, s] with a parameter-free LayerNorm (so the
probe sees the direction of h_l whatever the stream's scale), one GELU hidden layer of width
options["hidden"] = 256, depth embedding of size options["t_dim"] = 16, own AdamW (lr, wd, cosine
schedule of the run). Initialised from `self.gen`, so they do not touch the global RNG.

sb (target-propagation view): G_ψ(h, t_l, s) = h + rms(h) · MLP(LN(h), t_l, s) predicts h_L:

    ψ:    min  mean_{l<L, i} ‖G_ψ(h_l, t_l, s) − h_L‖² / ‖h_L‖²       states detached (normalised MSE)
    a_l = ∇_{h_l} ℓ(out_head(out_ln(G_ψ(h_l, t_l, s))), y)            l < L
    a_L = ∂ℓ/∂h_L                                                      (the bridge L → L is the identity)

cb (synthetic-gradient view): a scalar value net V_φ(h, t_l, s) = ⟨q_φ(LN(h), t_l, s), s⟩ with q_φ an
MLP with C outputs — the "logits · error" form of a first-order CE expansion, chosen because the
target gradient at h_L, ∂ℓ/∂h_L = J_readoutᵀ · e, is then reachable with q ≈ the readout's logits
(a plain scalar MLP must learn the bilinear e·W·LN(h) and needs far more steps to match it):

    a_l = ∇_{h_l} V_φ(h_l, t_l, s)                                     l = 0 … L
    φ:    min  mean_{l<L, i} (V_φ(h_l, t_l, s) − softmin_k V̄(h_{l+1} + σ_k ε_k, t_{l+1}, s))²   bridge consistency
             + Σ_i ‖∇_{h_L} V_φ − ∂ℓ_i/∂h_L‖² / Σ_i ‖∂ℓ_i/∂h_L‖²                                terminal gradient matching
    softmin_k v_k = −τ log (1/K) Σ_k exp(−v_k/τ),  ε_k ~ N(0, I),  σ = options["noise"] · rms(h_{l+1})
    V̄ ← ema · V̄ + (1 − ema) · V_φ after every step

Defaults: K = options["draws"] = 4, noise = 0.1, τ = options["tau"] = 1.0, ema = options["ema"] = 0.99.
Only gradients of V are used as credit, so its level is left free (no value target at depth L).
"""
from __future__ import annotations

import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..metrics import ce_gradient
from .local import LocalMethod, output_error

DEFAULTS = {"hidden": 256, "t_dim": 16, "draws": 4, "noise": 0.1, "tau": 1.0, "ema": 0.99, "lam": 0.0}


class Probe(nn.Module):
    """MLP(LN(h), t_l, s) → (M, out): the body shared by G_ψ and V_φ."""

    def __init__(self, d: int, n_classes: int, n_depths: int, hidden: int, t_dim: int, out: int):
        super().__init__()
        self.depth = nn.Embedding(max(n_depths, 1), t_dim)                  # t_l
        self.net = nn.Sequential(nn.Linear(d + t_dim + n_classes, hidden), nn.GELU(),
                                 nn.Linear(hidden, out))

    def forward(self, h, depth, s):
        return self.net(torch.cat([F.layer_norm(h, h.shape[-1:]), self.depth(depth), s], -1))


class _Bridge(LocalMethod):
    """Shared plumbing: options, the aux net with its optimizer, the local update."""

    option_defaults = DEFAULTS
    option_ranges = {"hidden": (1, math.inf), "t_dim": (1, math.inf), "draws": (1, math.inf),
                     "noise": (0.0, math.inf), "tau": (1e-12, math.inf), "ema": (0.0, 1.0),
                     "lam": (0.0, math.inf)}
    option_help = {"lam": "residual penalty λ in each block's local loss (the paper's SB/CB use 1e-2)"}

    predicts_state = False          # G_ψ outputs a state (d values), V_φ's q_φ C values

    def __init__(self, model, settings):
        super().__init__(model, settings)
        self.opts = self.resolve_options(settings.options)
        with torch.random.fork_rng(devices=[]):  # the aux net is built on the CPU: only its RNG is touched
            torch.default_generator.manual_seed(int(torch.randint(2 ** 62, (1,), generator=self.gen)))
            self.aux = Probe(math.prod(model.stream_shape), model.n_classes, model.n_blocks + 1, int(self.opts["hidden"]),
                             int(self.opts["t_dim"]), math.prod(model.stream_shape) if self.predicts_state else model.n_classes)
        like = model.head_parameters()[0]
        self.aux.to(device=like.device, dtype=like.dtype)
        self.opt = self.add_optimizer(self.local_param_groups())
        self.aux_opt = self.add_optimizer(self.aux.parameters())
        self.last_aux_loss = float("nan")

    def _inputs(self, hidden, e, layers):
        """Stack h_l for the given layers into one batch: (len·N, d), depth ids, s repeated."""
        n = e.shape[0]
        h = torch.cat([hidden[l] for l in layers])
        depth = torch.arange(len(layers), device=h.device).repeat_interleave(n) + layers[0]
        return h, depth, e.repeat(len(layers), 1)

    def train_step(self, x, y):
        fwd = self.local_forward(x)
        hidden, e = fwd.hidden, output_error(fwd.logits.detach(), y)           # s = e
        credit, aux_loss = self._credit_and_aux_loss(hidden, e, y)
        if aux_loss.requires_grad:                                              # (not with 0 blocks in sb)
            self.aux_opt.zero_grad(set_to_none=True)
            aux_loss.backward()
            self.aux_opt.step()
            self._after_aux_step()
        self.last_aux_loss = float(aux_loss.detach())
        return self.local_update(self.opt, y, fwd, credit, lam=float(self.opts["lam"]))

    def credit(self, x, y):
        with torch.no_grad():
            logits, hidden = self.model(x, return_hidden=True)
            e = output_error(logits, y)
        return self._credit_and_aux_loss(hidden, e, y, with_aux=False)[0]

    def _after_aux_step(self) -> None:
        pass

    def extra_state(self):
        return {"aux": dict(self.aux.state_dict())}

    def load_extra_state(self, state):
        self.aux.load_state_dict(state["aux"])


class StateBridge(_Bridge):
    name = "sb"
    predicts_state = True

    def predict(self, h, depth, e):
        """G_ψ(h, t_l, s) = h + rms(h) · MLP(LN(h), t_l, s) — scale-equivariant in h."""
        rms = h.pow(2).mean(-1, keepdim=True).sqrt()
        return h + rms * self.aux(h, depth, e)

    def _credit_and_aux_loss(self, hidden, e, y, with_aux: bool = True):
        n_blocks = self.model.n_blocks
        _, a_last = ce_gradient(self.model.readout, hidden[-1], y, reduction="none")            # a_L = ∂ℓ/∂h_L
        if n_blocks == 0:
            return [a_last], torch.zeros(())
        with torch.enable_grad():
            h, depth, s = self._inputs(hidden, e, list(range(n_blocks)))
            h = h.detach().requires_grad_(True)
            pred = self.predict(h, depth, s)                                     # G_ψ(h_l, t_l, s)
            ce = F.cross_entropy(self.model.readout(pred), y.repeat(n_blocks), reduction="sum")
            a = torch.autograd.grad(ce, h, retain_graph=True)[0]                 # a_l = ∇_{h_l} ℓ(G_ψ)
            target = hidden[-1].detach().repeat(n_blocks, 1)
            aux_loss = ((pred - target).pow(2).sum(-1)
                        / target.pow(2).sum(-1).clamp_min(1e-12)).mean()         # normalised MSE
        return list(a.detach().chunk(n_blocks)) + [a_last], aux_loss


class CreditBridge(_Bridge):
    name = "cb"

    def __init__(self, model, settings):
        super().__init__(model, settings)
        self.target = copy.deepcopy(self.aux).requires_grad_(False)               # V̄, the EMA copy

    def value(self, net, h, depth, e):
        return (net(h, depth, e) * e).sum(-1)                                    # V = ⟨q(h, t_l, s), s⟩

    def _credit_and_aux_loss(self, hidden, e, y, with_aux: bool = True):
        n_blocks, n = self.model.n_blocks, e.shape[0]
        with torch.enable_grad():
            h, depth, s = self._inputs(hidden, e, list(range(n_blocks + 1)))
            h = h.detach().requires_grad_(True)
            v = self.value(self.aux, h, depth, s)
            grad_v = torch.autograd.grad(v.sum(), h, create_graph=with_aux)[0]  # a_l = ∇_{h_l} V
            credit = list(grad_v.detach().chunk(n_blocks + 1))
            if not with_aux:
                return credit, None
            _, grad_last = ce_gradient(self.model.readout, hidden[-1], y, reduction="none")
            terminal = slice(n_blocks * n, None)
            aux_loss = ((grad_v[terminal] - grad_last).pow(2).sum()
                        / grad_last.pow(2).sum().clamp_min(1e-12))               # ∇V(h_L) ≈ ∂ℓ/∂h_L
            if n_blocks:
                aux_loss = aux_loss + (v[:n_blocks * n] - self._bridge_target(hidden, e)).pow(2).mean()
        return credit, aux_loss

    @torch.no_grad()
    def _bridge_target(self, hidden, e):
        """softmin_k V̄(h_{l+1} + σ ε_k, t_{l+1}, s) for l = 0 … L−1, stacked (L·N,)."""
        k, tau = int(self.opts["draws"]), float(self.opts["tau"])
        h, depth, s = self._inputs(hidden, e, list(range(1, self.model.n_blocks + 1)))
        sigma = float(self.opts["noise"]) * h.pow(2).mean(-1, keepdim=True).sqrt()
        eps = torch.randn((k,) + tuple(h.shape), generator=self.gen, dtype=torch.float64)
        noisy = h + sigma * eps.to(device=h.device, dtype=h.dtype)               # h_{l+1} + σ ε_k
        v = self.value(self.target, noisy.flatten(0, 1), depth.repeat(k), s.repeat(k, 1)).view(k, -1)
        return -tau * (torch.logsumexp(-v / tau, 0) - math.log(k))

    @torch.no_grad()
    def _after_aux_step(self):
        ema = float(self.opts["ema"])
        for p_bar, p in zip(self.target.parameters(), self.aux.parameters()):
            p_bar.mul_(ema).add_(p, alpha=1 - ema)                               # V̄ ← ema·V̄ + (1−ema)·V

    def extra_state(self):
        return {"aux": dict(self.aux.state_dict()), "target": dict(self.target.state_dict())}

    def load_extra_state(self, state):
        super().load_extra_state(state)
        self.target.load_state_dict(state["target"])
