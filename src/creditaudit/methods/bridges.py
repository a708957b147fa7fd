"""sb / cb — the state-bridge and credit-bridge diagnostic probes (docs/PROTOCOL.md).

Both learn an auxiliary net that maps a residual state h_l (plus a learned depth embedding t_l and the
output error s = e, detached) to a credit a_l; the blocks then train with the local loss on it, the
embedding with a_0, the head with CE (`LocalMethod.local_gradients`, per-block clip at settings.clip);
option `lam` > 0 adds dfa-penalty's λ · mean_i ‖f_l(h_l)_i‖² to each block's local loss (the paper
reports SB/CB with λ = 1e-2, which the audit presets use; the default 0 is the unpenalised probe).
The credits are in per-sample units (∂ℓ_i/∂h with ℓ_i the sample's CE, no 1/N), so the local loss
(f_l · a_{l+1}).sum(-1).mean() has the BP weight gradient's scale when the probe is exact.

Aux nets (choices; the paper is silent): input [LN(h_l), t_l, s] with a parameter-free LayerNorm (so the
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

Not on the plain MLP (arch mlp): refused at construction, before training. Its hidden positions
h_1 … h_L share one shape, but h_0 is the input (another width, no parameters) and both probes are
written over the L + 1 positions of one stream (one depth-indexed net over the concatenated states,
cb's bridge target from h_0 to h_1); a version on h_1 … h_L alone would be a different probe.

Any stream shape: the aux nets see h_l flattened to D = prod(model.stream_shape) values (the LN and
rms over all of them) and the credits come back in the stream's shape.

How cb is computed (same definition; MNIST-1D d=256 L=4 batch 128, one thread): one pass gives V_φ,
a_l = ∇_h V_φ and the aux loss's parameter gradient in closed form (`CreditBridge._member_value_pass`: no
autograd graph, no create_graph double backward — which also ran the second-order pass over all
L+1 layers where only the terminal one needs it; the credit comes from the local forward's states,
no second forward; LN and GELU derivatives by the fused aten kernels); V̄'s K draws share one noise
vector per (k, depth) across the batch, which turns V̄'s (K·L·N × D)·(D × H) product into
(L·N × D)·(D × H) (`_member_bridge_target`: 2.4 ms CPU per step, against 9.1 ms with per-sample float32
draws and 20.7 ms for the previous per-sample float64 draws); the noise is drawn in the model's dtype. Tested against the
autograd definition in float64 (tests/test_ep_cb.py). CPU time per epoch against BP
(benchmarks/method_speed.py, same run): 5.3–5.7× before, 2.4–2.6× after — about 1.2× of which is
the shared local update (dfa costs the same), the rest V_φ's forward, input gradient and weight
gradient over (L+1)·N rows plus V̄ over K·L·N. Where the rest of the time went (one thread, per
step, in units of BP's step): the local forward 0.34, the value pass 1.42 (of which V̄'s target
0.67), the local update 0.76, the optimizer steps 0.15; the value pass's matmuls (≈ 180M
multiply-adds against BP's ≈ 205M for the whole step) explain ≈ 0.9 of it, and the rest was page
faults on its large temporaries (u of V̄ alone is draws·L·N·H floats = 2 MiB), which the trainer's
`keep_freed_host_memory` removes: 3.0× → 2.15–2.25× (measured at load 6–8). The matmuls put the
floor at ≈ 1.9× with this computation. Test accuracy after 15 epochs (λ = 1e-2, seeds
42 / 123 / 456): 0.666 / 0.653 / 0.642 before, 0.663 / 0.653 / 0.643 after; Γ unchanged.
Where it differs from the original: sb and cb are the audited paper's own diagnostic probes
(docs/PROTOCOL.md), not published learning rules, so there is no outside reference code; cb's value
net is in the family of synthetic gradients (Jaderberg et al. 2017, "Decoupled neural interfaces"),
but DNI regresses a module's gradient on the next module's synthetic gradient, while cb learns a
scalar value V_φ whose input gradient is the credit, by the bridge consistency and terminal
gradient matching above. The blocks learn from the credit as every local method here does
(backprop of a_{l+1} through the block; per-block clip; AdamW).
"""
from __future__ import annotations

import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import CreditAuditError
from ..metrics import ce_gradient
from ..model.members import flat_members, member_linear
from ..model.resmlp import ResidualMLP
from ..model.resnet import SmallResNet
from ..model.vit import ViTMini
from ..seeding import draw_on_host
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


def probe_params(probe: Probe) -> dict[str, torch.Tensor]:
    """A lone probe's parameters as a stack of one, {name: (1, *shape)} (views: gradients reach them)."""
    return {name: p.unsqueeze(0) for name, p in probe.named_parameters()}


def member_probe(p: dict[str, torch.Tensor], h: torch.Tensor, depth: torch.Tensor,
                 s: torch.Tensor) -> torch.Tensor:
    """`Probe.forward` of K members at once: p their stacked parameters {name: (K, *shape)},
    h (K, M, D), depth ids (M,), s (K, M, C) → (K, M, out); member k reads only its own."""
    z = torch.cat([F.layer_norm(h, h.shape[-1:]), p["depth.weight"][:, depth], s], -1)
    z = F.gelu(member_linear(z, p["net.0.weight"], p["net.0.bias"]))
    return member_linear(z, p["net.2.weight"], p["net.2.bias"])


def member_ce_gradient(readout, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """∂ℓ_i/∂h_i of each sample's CE (per-sample units) for K members: h (K, N, D), y (K, N),
    `readout` (K, N, D) → (K, N, C)."""
    return ce_gradient(lambda leaf: readout(leaf).flatten(0, 1), h, y.flatten(), reduction="none")[1]


class _Bridge(LocalMethod):
    """Shared plumbing: options, the aux net with its optimizer, the local update.

    The probe's arithmetic is written once, over a leading member axis (K runs of one model
    shape — ResMLP, vit-mini or resnet-small, their states seen flat (`flat_members`) —, each
    with its own probe: `member_probe`, stacked parameters from `MemberStack.modules`);
    a lone run computes it as a stack of one (`probe_params`, states flattened and unsqueezed)."""

    # the knobs both bridges read; cb's own (its bridge target's draws, noise, τ, EMA) are declared
    # on cb alone, so an sb run refuses them instead of keying a run on a knob it never reads
    option_defaults = {k: DEFAULTS[k] for k in ("hidden", "t_dim", "lam")}
    # counts are bounded like every count of a run (config.MAX_COUNT, which sits above methods/):
    # a larger one is a typo that would exhaust memory, not a plan
    option_ranges = {"hidden": (1, 100_000), "t_dim": (1, 100_000), "lam": (0.0, math.inf)}
    option_help = {"hidden": "hidden width of the probe MLP (G_ψ for sb, V_φ for cb)",
                   "t_dim": "size of the learned depth embedding t_l",
                   "lam": "residual penalty λ in each block's local loss (the paper's SB/CB use 1e-2)"}
    trainable_only_options = {"lam": 0.0}      # λ‖f_l‖² enters only trainable blocks' local loss

    predicts_state = False          # G_ψ outputs a state (D values), V_φ's q_φ C values

    def __init__(self, model, settings):
        if not getattr(model, "residual", True):
            raise CreditAuditError(
                f"method {self.name!r} does not train arch mlp: its probe reads every position "
                "h_0 … h_L as one residual stream of one shape, and the plain MLP's h_0 is the input "
                "(another width, no embedding to train); train it on resmlp, vit-mini or resnet-small")
        super().__init__(model, settings)
        self.opts = self.resolve_options(settings.options)
        self.stream_shape = tuple(model.stream_shape)
        self.d_flat = math.prod(self.stream_shape)        # the aux nets see the flattened state
        with torch.random.fork_rng(devices=[]):  # the aux net is built on the CPU: only its RNG is touched
            torch.default_generator.manual_seed(int(torch.randint(2 ** 62, (1,), generator=self.gen)))
            self.aux = Probe(self.d_flat, model.n_classes, model.n_blocks + 1, int(self.opts["hidden"]),
                             int(self.opts["t_dim"]), self.d_flat if self.predicts_state else model.n_classes)
        like = model.head_parameters()[0]
        self.aux.to(device=like.device, dtype=like.dtype)
        self.opt = self.add_optimizer(self.local_param_groups())
        self.aux_opt = self.add_optimizer(self.aux.parameters())
        self.lam = float(self.opts["lam"])          # a Python number: the step never reads a tensor
        self._last_aux_loss: torch.Tensor | float = float("nan")

    def member_modules(self):
        return {"aux": self.aux}

    def member_sync(self, stack, k):
        self._last_aux_loss = stack.log.aux_loss[k].clone()

    def _lone_states(self, hidden) -> list[torch.Tensor]:
        """h_0 … h_L of a lone run as a stack of one, flattened: (1, N, D) each."""
        return [self._flat(h).unsqueeze(0) for h in hidden]

    def _lone_readout(self, h: torch.Tensor) -> torch.Tensor:
        """The lone model's readout as a stack of one: (1, M, D) → (1, M, C)."""
        return self.model.readout(h.view((-1,) + self.stream_shape)).unsqueeze(0)

    @property
    def last_aux_loss(self) -> float:
        """The last step's aux loss as a float (kept as a tensor until asked: no host sync per step)."""
        return float(self._last_aux_loss)

    def _flat(self, h: torch.Tensor) -> torch.Tensor:
        return h.reshape(h.shape[0], self.d_flat)

    def _stream(self, a: torch.Tensor) -> torch.Tensor:
        return a.view((a.shape[0],) + self.stream_shape)

    def _inputs(self, hidden, e, layers):
        """Stack the flattened h_l for the given layers into one batch: (len·N, D), depth ids, s repeated."""
        n = e.shape[0]
        h = torch.cat([self._flat(hidden[l]) for l in layers])
        depth = torch.arange(len(layers), device=h.device).repeat_interleave(n) + layers[0]
        return h, depth, e.repeat(len(layers), 1)

    def gradients(self, x, y):
        """The aux net's gradient and the local update's, in that order. Their parameter sets are
        disjoint and the credit is computed before either moves, so stepping both optimizers
        afterwards (`apply_gradients`) is the aux step followed by the local step."""
        fwd = self.local_forward(x)
        hidden, e = fwd.hidden, output_error(fwd.logits.detach(), y)           # s = e
        credit, aux_loss = self._credit_and_aux_loss(hidden, e, y)
        if aux_loss.requires_grad:                          # structural (no blocks in sb), not data
            aux_loss.backward()
        self._last_aux_loss = aux_loss.detach()
        return self.local_gradients(y, fwd, credit, lam=self.lam)

    def apply_gradients(self):
        super().apply_gradients()       # an optimizer whose parameters got no .grad leaves them be
        self._after_aux_step()
        if isinstance(self._last_aux_loss, torch.Tensor):   # own it: a CUDA-graph step reuses
            self._last_aux_loss = self._last_aux_loss.clone()   # its output memory next step

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
    paper = True
    summary = "state bridge: a_l = ∇_{h_l} CE(readout(G_ψ(h_l, t_l, e))), G_ψ trained to predict h_L"
    predicts_state = True
    member_archs = (ResidualMLP, ViTMini, SmallResNet)

    def exact_positions(self, n_blocks):
        """{L}: the bridge L → L is the identity, a_L = ∂ℓ/∂h_L (per sample, no 1/N). cb has no
        exact position: its a_L = ∇_{h_L} V_φ only learns to match ∂ℓ/∂h_L."""
        return frozenset({n_blocks})

    def _credit_and_aux_loss(self, hidden, e, y, with_aux: bool = True):
        """The lone step's: `_member_credit` of a stack of one (aux loss 0 without blocks)."""
        credit, loss = self._member_credit(probe_params(self.aux), self._lone_states(hidden),
                                           e.unsqueeze(0), y.unsqueeze(0), self._lone_readout, with_aux)
        return ([self._stream(c[0]) for c in credit],
                loss[0] if loss is not None else torch.zeros(()) if with_aux else None)

    @staticmethod
    def _member_credit(p, hidden, e, y, readout, with_aux: bool = True):
        """a_0 … a_L (each (K, N, D)) and each member's aux loss (K,) (None without blocks, or
        with_aux False), for K members: p G_ψ's parameters stacked (K, …), hidden the states
        h_l (K, N, D), e (K, N, C), y (K, N), `readout` (K, M, D) → (K, M, C).

            G_ψ(h, t_l, s) = h + rms(h) · MLP(LN(h), t_l, s)        scale-equivariant in h
        """
        n_blocks, n = len(hidden) - 1, e.shape[1]
        a_last = member_ce_gradient(readout, hidden[-1], y)                      # a_L = ∂ℓ/∂h_L
        if n_blocks == 0:
            return [a_last], None
        with torch.enable_grad():
            h = torch.cat(hidden[:-1], 1).detach().requires_grad_(True)         # (K, L·N, D)
            depth = torch.arange(n_blocks, device=h.device).repeat_interleave(n)
            rms = h.pow(2).mean(-1, keepdim=True).sqrt()
            pred = h + rms * member_probe(p, h, depth, e.repeat(1, n_blocks, 1))  # G_ψ(h_l, t_l, s)
            ce = F.cross_entropy(readout(pred).flatten(0, 1), y.repeat(1, n_blocks).flatten(),
                                 reduction="sum")
            a = torch.autograd.grad(ce, h, retain_graph=with_aux)[0]             # a_l = ∇_{h_l} ℓ(G_ψ)
            credit = list(a.detach().chunk(n_blocks, 1)) + [a_last]
            if not with_aux:
                return credit, None
            target = hidden[-1].detach().repeat(1, n_blocks, 1)
            aux_loss = ((pred - target).pow(2).sum(-1)
                        / target.pow(2).sum(-1).clamp_min(1e-12)).mean(1)        # normalised MSE
        return credit, aux_loss

    def member_gradients(self, stack, x, y):
        """The lone step per member: each member's G_ψ (its slices of `stack.modules["aux"]`)
        gives its credit and is fitted on its own states; the local update as dfa's."""
        net = flat_members(stack.net)                # the probes read flat states, as lone
        fwd = self.member_local_forward(net, x, stack.trained)
        e = output_error(fwd.logits.detach(), y)                                  # s = e, (K, B, C)
        credit, aux_loss = self._member_credit(stack.modules["aux"], fwd.hidden, e, y, net.readout)
        if aux_loss is None:                                # structural (no blocks), not data
            aux_loss = e.new_zeros(e.shape[0])
        else:
            aux_loss.sum().backward()                       # members share no ψ: each its own gradient
        stack.log.aux_loss = aux_loss.detach()
        return self.member_local_gradients(net, y, fwd, credit, stack.trains, lam=self.lam)


class _Normalised:
    """n = LN(h) over the last dim without affine parameters (exactly F.layer_norm), keeping what
    its VJP needs; `vjp(g)` = (∂n/∂h)ᵀ g = rstd·(g − mean(g) − n·mean(n⊙g)) in one fused kernel.
    The Jacobian is symmetric, so this is also its JVP. `start` restricts it to the rows from
    `start` on (the second-last dim: h may carry a leading member axis)."""

    def __init__(self, h: torch.Tensor, eps: float = 1e-5):
        self.h, self.eps = h, eps
        self.n, self.mean, self.rstd = torch.native_layer_norm(h, h.shape[-1:], None, None, eps)

    def vjp(self, g: torch.Tensor, start: int = 0) -> torch.Tensor:
        # the kernel reads mean/rstd as contiguous rows: a row slice of (K, M, ·) is not. (An int,
        # not a slice default: torch 2.11's Dynamo cannot wrap a slice constant, and the step
        # then trains eagerly.)
        h, mean, rstd = (t[..., start:, :].contiguous() for t in (self.h, self.mean, self.rstd))
        return torch.ops.aten.native_layer_norm_backward(
            g.contiguous(), h, self.h.shape[-1:], mean, rstd, None, None, [True, False, False])[0]


_INV_SQRT_2PI = 1.0 / math.sqrt(2 * math.pi)


def _gelu_grad_times(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """w ⊙ gelu'(u) for the exact (erf) GELU of nn.GELU(), in one fused kernel (differentiable:
    autograd knows GELU's second derivative)."""
    return torch.ops.aten.gelu_backward(w, u)


class CreditBridge(_Bridge):
    """cb with V_φ, ∇_h V_φ and the aux loss's gradient in one first-order pass (`_value_pass`)
    and the bridge target from shared noise draws (`_bridge_target`)."""

    name = "cb"
    paper = True
    member_archs = (ResidualMLP, ViTMini, SmallResNet)
    summary = "credit bridge: a_l = ∇_{h_l} V_φ, V_φ a value net trained by bridge consistency"
    option_defaults = {**_Bridge.option_defaults, **{k: DEFAULTS[k] for k in ("draws", "noise", "tau", "ema")}}
    # draws: each is one probe pass over the batch per block and step; the default is 4, and
    # 1024 (256× that) already makes a step cost more than a thousand forwards: larger is a typo
    option_ranges = {**_Bridge.option_ranges, "draws": (1, 1024), "noise": (0.0, math.inf),
                     "tau": (1e-12, math.inf), "ema": (0.0, 1.0)}
    option_help = {**_Bridge.option_help,
                   "draws": "noise draws K of the soft-min bridge target",
                   "noise": "noise scale σ = noise · rms(h_{l+1}) of those draws",
                   "tau": "soft-min temperature τ",
                   "ema": "EMA rate of the target value net V̄"}

    def __init__(self, model, settings):
        super().__init__(model, settings)
        self.target = copy.deepcopy(self.aux).requires_grad_(False)               # V̄, the EMA copy
        self._noise: torch.Tensor | None = None

    def value(self, net, h, depth, e):
        """V = ⟨q(h, t_l, s), s⟩ through `Probe.forward` (h flattened): the reference definition that
        `_value_pass` and `_bridge_target` compute in closed form (tested against it)."""
        return (net(h, depth, e) * e).sum(-1)                                    # V = ⟨q(h, t_l, s), s⟩

    def _split(self, p: dict[str, torch.Tensor], e: torch.Tensor, depths: slice):
        """W1 = [W1_h | W1_t | W1_s] of K probes (stacked parameters p): returns W1_h (K, H, D)
        and the bias of every (depth, sample) row, W1_t·t_l + W1_s·s + b1, (K, depths, N, H) —
        the t_l and s parts computed once, not per row. e: (K, N, C)."""
        w1, d = p["net.0.weight"], self.d_flat
        t = p["depth.weight"].shape[-1]
        w_h, w_t, w_s = w1[..., :d], w1[..., d:d + t], w1[..., d + t:]
        table = torch.baddbmm(p["net.0.bias"][:, None], p["depth.weight"][:, depths],
                              w_t.transpose(1, 2))                                 # (K, depths, H)
        return w_h, table[:, :, None, :] + torch.bmm(e, w_s.transpose(1, 2))[:, None]   # + (K, 1, N, H)

    def _value_pass(self, hidden, e, y, with_aux: bool, noise: torch.Tensor | None = None):
        """The lone step's: `_member_value_pass` of a stack of one (ε drawn now when not given)."""
        if with_aux and self.model.n_blocks and noise is None:
            noise = self._draw_noise(self.model.n_blocks, e)
        credit, grads, loss = self._member_value_pass(
            probe_params(self.aux), probe_params(self.target), self._lone_states(hidden),
            e.unsqueeze(0), y.unsqueeze(0), self._lone_readout, with_aux,
            None if noise is None else noise.unsqueeze(0))
        credit = [self._stream(c[0]) for c in credit]
        if not with_aux:
            return credit, None, None
        return credit, {name: g[0] for name, g in grads.items()}, loss[0]

    def _member_value_pass(self, p, target, hidden, e, y, readout, with_aux: bool, noise=None):
        """V_φ on h_0 … h_L, its gradient a_l = ∇_{h_l} V_φ, and the aux loss's gradient in φ, all
        in closed form (no autograd graph; tested against the autograd definition in float64),
        for K members at once: p, target the stacked parameters of V_φ and V̄ {name: (K, …)},
        hidden h_l (K, N, D), e (K, N, C), y (K, N), `readout` (K, M, D) → (K, M, C), noise the
        members' ε (K, draws, L, D). Every sum below is per member.

        With n = LN(h), u = W1_h n + W1_t t_l + W1_s s + b1, w = W2ᵀ s:
            V = ⟨gelu(u), w⟩ + ⟨b2, s⟩,   δ = ∂V/∂u = gelu'(u) ⊙ w,   ∇_h V = LN'(h)ᵀ W1_hᵀ δ.
        Bridge term B = mean_{l<L, i} (V − target)²: with c = ∂B/∂V, ∂B/∂u = c·δ and
        ∂B/∂W2 = Σ c·s ⊗ gelu(u).
        Terminal term T = Σ‖∇_h V(h_L) − g‖²/Z: ∂T/∂φ = ∂/∂φ ⟨δ, W1_h ṅ⟩ with ṅ = LN'(h)·R and
        R = 2(∇_h V − g)/Z (LN' is symmetric), so ∂T/∂W1_h = δᵀ ṅ, ∂T/∂u = w ⊙ gelu''(u) ⊙ P and
        ∂T/∂W2 = s ⊗ (gelu'(u) ⊙ P), P = W1_h ṅ — the create_graph double backward over all L+1
        layers it replaces cost ~2× more. Returns (credit [(K, N, D)], grads by aux parameter
        name (K, …) or None, each member's aux loss B + T (K,) or None)."""
        n_blocks, (k, n) = len(hidden) - 1, e.shape[:2]
        out_w, out_b, emb_all = p["net.2.weight"], p["net.2.bias"], p["depth.weight"]
        t = emb_all.shape[-1]
        w_t = p["net.0.weight"][..., self.d_flat:self.d_flat + t]
        emb = emb_all[:, :n_blocks + 1]                                           # t_0 … t_L
        with torch.no_grad():
            h = torch.cat(hidden, 1)                                              # (K, M, D), M = (L+1)·N
            ln = _Normalised(h)
            nrm = ln.n
            w_h, bias = self._split(p, e, slice(0, n_blocks + 1))                 # W1_t t_l + W1_s s + b1
            u = torch.baddbmm(bias.flatten(1, 2), nrm, w_h.transpose(1, 2)).view(k, n_blocks + 1, n, -1)
            w = torch.bmm(e, out_w)                                               # W2ᵀ s, (K, N, H)
            delta = _gelu_grad_times(w[:, None].expand_as(u), u)                  # ∂V/∂u
            grad_h = ln.vjp(torch.bmm(delta.flatten(1, 2), w_h))                  # a_l = ∇_{h_l} V
            credit = list(grad_h.chunk(n_blocks + 1, 1))
            if not with_aux:
                return credit, None, None
            grad_last = member_ce_gradient(readout, hidden[-1], y)               # ∂ℓ_i/∂h_L
            diff = grad_h[:, n_blocks * n:] - grad_last
            z = grad_last.pow(2).sum((1, 2)).clamp_min(1e-12)                    # (K,)
            loss = diff.pow(2).sum((1, 2)) / z                                    # ∇V(h_L) ≈ ∂ℓ/∂h_L
            tangent = ln.vjp(diff.mul_((2 / z)[:, None, None]), n_blocks * n)     # LN'(h_L)·R
            p_t = torch.bmm(tangent, w_h.transpose(1, 2))                         # P, (K, N, H)
            u_last = u[:, n_blocks]
            curv = torch.exp(-0.5 * u_last * u_last).mul_(_INV_SQRT_2PI) * (2 - u_last * u_last)
            d_u = torch.empty_like(u)
            d_u[:, n_blocks] = w * p_t * curv                                     # ∂T/∂u (gelu'')
            g_w2 = torch.bmm(e.transpose(1, 2), _gelu_grad_times(p_t, u_last))    # ∂T/∂W2 = s ⊗ ∂T/∂w
            g_b2 = torch.zeros_like(out_b)
            if n_blocks:
                act = F.gelu(u[:, :n_blocks]).flatten(1, 2)                       # (K, L·N, H)
                q = member_linear(act, out_w, out_b).view(k, n_blocks, n, -1)
                v = (q * e[:, None]).sum(-1)                                      # V(h_l), l < L
                err = v - self._member_bridge_target(target, e, ln, noise).view(k, n_blocks, n)
                loss = loss + err.pow(2).mean((1, 2))
                c = err.mul_(2 / (n_blocks * n))                                  # ∂B/∂V, (K, L, N)
                d_u[:, :n_blocks] = delta[:, :n_blocks] * c[..., None]            # ∂B/∂u
                ce = (c[..., None] * e[:, None]).flatten(1, 2)                    # c·s, (K, L·N, C)
                g_w2 = torch.baddbmm(g_w2, ce.transpose(1, 2), act)               # + Σ c·s ⊗ gelu(u)
                g_b2 = ce.sum(1)
            d_rows = d_u.sum(2)                                                   # Σ_i ∂/∂u per depth
            g_w1 = torch.cat([torch.baddbmm(torch.bmm(delta[:, n_blocks].transpose(1, 2), tangent),
                                            d_u.flatten(1, 2).transpose(1, 2), nrm),
                              torch.bmm(d_rows.transpose(1, 2), emb),
                              torch.bmm(d_u.sum(1).transpose(1, 2), e)], -1)
            g_emb = torch.zeros_like(emb_all)
            g_emb[:, :n_blocks + 1] = torch.bmm(d_rows, w_t)
            grads = {"depth.weight": g_emb, "net.0.weight": g_w1, "net.0.bias": d_rows.sum(1),
                     "net.2.weight": g_w2, "net.2.bias": g_b2}
        return credit, grads, loss

    def prepare_step(self):
        """V̄'s noise for the next step, drawn here, outside `gradients` (a compiled graph
        cannot hold a generator)."""
        self._noise = self._draw_noise(self.model.n_blocks, self.model.head_parameters()[0])

    def gradients(self, x, y):
        fwd = self.local_forward(x)
        e = output_error(fwd.logits.detach(), y)                                  # s = e
        credit, grads, loss = self._value_pass(fwd.hidden, e, y, with_aux=True, noise=self._noise)
        for name, param in self.aux.named_parameters():
            param.grad = grads[name]
        self._last_aux_loss = loss
        return self.local_gradients(y, fwd, credit, lam=self.lam)

    # -- on the member axis ----------------------------------------------------------------------
    def member_modules(self):
        return {"aux": self.aux, "target": self.target}

    def member_prepare_step(self, stack):
        """Every member's ε from its own generator, exactly its lone run's draws: (K, draws, L, D)."""
        like = stack.net.params["out_head.weight"]
        return {"noise": torch.stack([m._draw_noise(stack.net.n_blocks, like) for m in stack.methods])}

    def member_gradients(self, stack, x, y):
        """The lone step per member: member k's V_φ, V̄ (its slices of `stack.modules`) and ε
        (`stack.drawn`); the aux gradient in closed form per member; the local update as dfa's."""
        net = flat_members(stack.net)                # the probes read flat states, as lone
        fwd = self.member_local_forward(net, x, stack.trained)
        e = output_error(fwd.logits.detach(), y)                                  # s = e, (K, B, C)
        aux = stack.modules["aux"]
        credit, grads, loss = self._member_value_pass(aux, stack.modules["target"], fwd.hidden, e, y,
                                                      net.readout, True, stack.drawn["noise"])
        for name, param in aux.items():
            param.grad = grads[name]
        stack.log.aux_loss = loss
        return self.member_local_gradients(net, y, fwd, credit, stack.trains, lam=self.lam)

    @torch.no_grad()
    def member_after_step(self, stack):
        self._lerp_target(stack.modules["target"].values(), stack.modules["aux"].values())

    def _credit_and_aux_loss(self, hidden, e, y, with_aux: bool = True):
        if with_aux:
            raise NotImplementedError("cb computes its aux gradient in closed form: see train_step")
        return self._value_pass(hidden, e, y, False)[0], None

    def _draw_noise(self, n_blocks: int, like: torch.Tensor) -> torch.Tensor:
        """ε_{k,l} ~ N(0, I), (draws, L, D): one draw per (k, depth), shared by the batch's samples,
        from the method's CPU generator and copied to `like`'s device (`draw_on_host`: the same
        numbers on any device, no host sync)."""
        return draw_on_host(torch.randn, (int(self.opts["draws"]), n_blocks, self.d_flat), self.gen, like)

    @torch.no_grad()
    def _bridge_target(self, hidden, e, noise: torch.Tensor | None = None):
        """The lone run's bridge target (`_member_bridge_target` of a stack of one), (L·N,);
        `noise` ε drawn beforehand, None draws it now."""
        ln = _Normalised(torch.cat(self._lone_states(hidden), 1))
        noise = self._draw_noise(self.model.n_blocks, e) if noise is None else noise
        return self._member_bridge_target(probe_params(self.target), e.unsqueeze(0), ln,
                                          noise.unsqueeze(0))[0]

    @torch.no_grad()
    def _member_bridge_target(self, target, e, ln: _Normalised, noise: torch.Tensor) -> torch.Tensor:
        """softmin_k V̄(h_{l+1} + σ ε_{k,l}, t_{l+1}, s) for l = 0 … L−1, per member (K, L·N):
        target V̄'s stacked parameters, e (K, N, C), ln the `_Normalised` of h_0 … h_L (K, M, D),
        noise each member's ε (K, draws, L, D).

        The draws are shared by the batch's samples (each sample still sees `draws` independent
        N(0, I) draws per depth, so its target has the same distribution; the batch's terms are
        correlated). That makes V̄'s big matmul per-sample-free: with c(·) the centring,
        W1_h·LN(h + σε) = rstd · (W1_h c(h) + σ W1_h c(ε)) and
        rstd⁻² = (‖c(h)‖² + 2σ⟨c(h), ε⟩ + σ²‖c(ε)‖²)/D + 1e-5, so the (draws·L·N × D)·(D × H)
        product of the per-sample draws becomes (L·N × D)·(D × H) plus (draws·L × D)·(D × H)."""
        draws, tau = int(self.opts["draws"]), float(self.opts["tau"])
        k, n = e.shape[:2]
        n_blocks = ln.h.shape[1] // n - 1
        rows = slice(n, None)                                                     # h_1 … h_L
        nrm = ln.n[:, rows].view(k, n_blocks, n, -1)                              # c(h)·rstd_h, (K, L, N, D)
        rstd_h = ln.rstd[:, rows].view(k, n_blocks, n)
        var_h = rstd_h.pow(-2) - ln.eps                                           # ‖c(h)‖²/D
        mean_h = ln.mean[:, rows].view(k, n_blocks, n)
        sigma = float(self.opts["noise"]) * (var_h + mean_h.pow(2)).sqrt()        # noise·rms(h), (K, L, N)
        ec = noise - noise.mean(-1, keepdim=True)                                 # c(ε), (K, draws, L, D)
        w_h, bias = self._split(target, e, slice(1, n_blocks + 1))                # (K, H, D), (K, L, N, H)
        # batched products over the members (each member's terms its own)
        w_ht = w_h.transpose(1, 2)                                                # (K, D, H)
        a = torch.bmm(nrm.flatten(1, 2), w_ht).view(k, n_blocks, n, -1)          # W1_h c(h)·rstd_h
        b = torch.bmm(ec.flatten(1, 2), w_ht).view(k, draws, n_blocks, -1)        # W1_h c(ε), (K, draws, L, H)
        cross = torch.bmm(nrm.flatten(0, 1), ec.permute(0, 2, 3, 1).flatten(0, 1))   # ⟨c(h), ε⟩·rstd_h …
        cross = cross.view(k, n_blocks, n, draws).permute(0, 3, 1, 2) / rstd_h[:, None]  # … (K, draws, L, N)
        var = var_h[:, None] + (2 * sigma[:, None] * cross
                                + sigma.pow(2)[:, None] * ec.pow(2).sum(-1)[..., None]) / self.d_flat
        rstd = (var + ln.eps).rsqrt()[..., None]                                  # (K, draws, L, N, 1)
        # u written into a contiguous (K, draws, L, N, H) buffer: from these broadcast inputs
        # addcmul would pick a draws-innermost layout, whose strided writes, GELU and the copy that
        # flatten() then needs cost more than the rest of the target (same values either way)
        u = bias.new_empty((k, draws, n_blocks, n, bias.shape[-1]))
        torch.addcmul(bias[:, None], rstd / rstd_h[:, None, ..., None], a[:, None], out=u)
        u.addcmul_(rstd * sigma[:, None, ..., None], b[:, :, :, None, :])         # … in two passes
        q = member_linear(torch.ops.aten.gelu_(u).flatten(1, 3), target["net.2.weight"],  # u is spent:
                          target["net.2.bias"])                                           # GELU in place
        v = (q.view(k, draws, n_blocks, n, -1) * e[:, None, None]).sum(-1)       # V̄, (K, draws, L, N)
        return -tau * (torch.logsumexp(-v.flatten(2) / tau, 1) - math.log(draws))

    def _lerp_target(self, target, aux) -> None:
        """V̄ ← ema·V̄ + (1−ema)·V_φ, tensor by tensor (lone or stacked: elementwise)."""
        torch._foreach_lerp_(list(target), list(aux), 1 - float(self.opts["ema"]))

    @torch.no_grad()
    def _after_aux_step(self):
        self._lerp_target(self.target.parameters(), self.aux.parameters())

    def extra_state(self):
        return {"aux": dict(self.aux.state_dict()), "target": dict(self.target.state_dict())}

    def load_extra_state(self, state):
        super().load_extra_state(state)
        self.target.load_state_dict(state["target"])
