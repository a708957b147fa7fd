"""ep — equilibrium propagation (Scellier & Bengio 2017) on the chain energy of the network.

    E(h)   = ½ Σ_l Σ_i ‖r_{l,i}‖²,   r_l = h_{l+1} − h_l − f_l(h_l)       summed over batch and features
                                     r_l = h_{l+1} − f_l(h_l)             on the plain MLP (no skip)
    F(h)   = E(h) + β · CE(readout(h_L), y)                                CE mean-reduced (the model's
                                                                           loss: BCE where it is built so)

Below, (I + ∂f_l) is the Jacobian of the step h_l ↦ h_{l+1}; on the plain MLP (arch mlp, no skip)
read ∂f_l alone, and h_0 = x, the input itself (clamped as in Scellier & Bengio; it has no
parameters, so a_0 trains nothing there and is reported for the protocol only).

Free phase: the forward pass, h^free (r = 0, E = 0). Nudged phase: the minimiser h^β of F over the
free states h_1 … h_L with h_0 clamped, started from h^free. Its stationarity conditions are

    ∂F/∂h_L = r_{L−1} + β · ∂CE/∂h_L(h_L)                   = 0
    ∂F/∂h_l = r_{l−1} − (I + ∂f_l(h_l))ᵀ r_l                = 0      l = 1 … L−1

i.e., in credit units a_{l+1} = −r_l/β:  a_L = ∂CE/∂h_L(h_L^β),  a_l = (I + ∂f_l(h_l^β))ᵀ a_{l+1}. As
β → 0 the nudged states tend to the free ones and a_l → g_l = ∂CE/∂h_l, the BP gradient of the
mean CE; at finite β every Jacobian and the output gradient are taken at the nudged states.

Relaxation (`relax`): the energy is a chain, so it is relaxed in the residual coordinates r (with
h_0 clamped, r ↦ h is a bijection: h_{l+1} = h_l + f_l(h_l) + r_l, or f_l(h_l) + r_l), where F = ½‖r‖² + β·CE(h(r)) has
the gradient ∂F/∂r_l = r_l + β·T_{l+1} = β·d_{l+1}, with a = −r/β and

    d(a) = T(a) − a,   T_L = ∂CE/∂h_L,   T_l = (I + ∂f_l)ᵀ T_{l+1}       at the states h(a)

One sweep = one forward through the chain at the current residuals + one input-only backward
(autograd from CE to h_1 … h_L, no weight gradients) gives T(a), hence ∂F/∂r. d = 0 is exactly
∂F/∂h = 0: the same energy, the same nudged equilibrium. In these coordinates the Hessian is
I + β·∇²_r CE, whose stiff part is the CE's curvature through the readout (rank ≤ C−1 per sample), so
plain steps a ← a + d already converge at small β/N (d(0) = g: the first sweep from the free state
is a BP pass), and per-sample L-BFGS steps (memory 5, H_0 = γ_i·I with γ_i ≤ 1 from the last pair)
handle the stiffer samples. Safeguard: a step that would raise a sample's F_i is rejected and that
sample's step length halved (options["alpha"] = its first step length), so no sample can diverge
(F_i(h^β) ≤ F_i(h^free), tested up to β = 1e4). The step never reads a tensor on the host: the
last sweep's acceptance test is a masked update (credit ← where(F_i did not rise, trial, credit)),
followed by the forward that keeps the parameters' graph. "steps" counts sweeps: `steps` = K costs
K+2 forwards (the last trial's energy is a no-grad forward) and K input-only backwards, then the
update's backward (f_0(h_0) is computed once: h_0 is clamped); option "tol" > 0 freezes the
credit once ‖d‖ ≤ tol·‖d(0)‖ (a masked update too: later sweeps still run, and change nothing),
so it bounds the relaxation without saving time.
The credit the diagnosis reads (`credit`, hence Γ) is relaxed the same way on a float64 copy of
the model, with one change to the test: a trial whose F_i rose by no more than F_i's own rounding
error (`rounding_margin`, 2¹⁰·eps·(1 + max_j |z_ij|)/N) is accepted. In float32 a confident sample's
trial changes F_i by ≈ ½β‖g_i‖² ∝ ℓ_i², far below the rounding of ℓ_i (≈ eps·|z|), so its
acceptance was a coin toss on the last bits: on a zoo run (MNIST-1D, d = 256, 15 epochs) 47 of the
1000 eval samples kept a = 0 (cos 0), and moving the weights by one ulp flipped 1–3 of them, each
moving Γ by 1/1000 (Γ 0.952 ± 0.003 by the bit pattern; 0.9988 now, ±2e-9 under a 1-ulp move).
Training keeps the float32 strict test (a run computes what it did, TRAINING_CODE_VERSION
unchanged): a training step likewise gives such samples a = 0 or a step at random, and their
gradient is ∝ ℓ_i, a small share of the batch's. `trained_credit` is the credit exactly as the
step computes it (the model's dtype, the strict test); the diagnosis reports its Γ beside the
float64 one (`gamma_trained`; MNIST-1D d = 256 L = 4 seed 42: 0.99996 both after 5 epochs, 0.999
against 0.952 as trained after 15). docs/PROTOCOL.md §3.13.
Samples relax independently for a per-sample model; for one that couples samples (BatchNorm in
training mode) the sweeps still solve the joint system, since each backward is the batch's own.

Convergence (`epoch_log`): after the last sweep, the weight-update backward also yields the VJPs at
the final states, hence the exact stationarity gradient there, reported scale-free as

    ep_residual = ‖∂F/∂h(h^β)‖ / ‖∂F/∂h(h^free)‖ = ‖∂F/∂h(h^β)‖ / (β ‖∂CE/∂h_L(h_L^free)‖)

(norms over the whole batch and all free layers; 1 = nothing relaxed, 0 = exact equilibrium),
averaged over the epoch's steps, and ep_steps = the mean number of sweeps.

The EP weight update is −(1/β) ∂E/∂θ at h^β:

    block l:   Σ_i a_{l+1,i} · ∂f_l(h_l^β)_i/∂θ            the local loss on a_{l+1}, states detached
    embed:     Σ_i embed(x_i) · a_{0,i}                    with a_0 = (1/β) ∂E/∂h_0 = (I + ∂f_0)ᵀ a_1
    head:      CE(readout(h_L^β.detach()), y)

Credit, l = 0 … L (detached):

    a_l = −r_{l−1}(h^β)/β = (h_{l−1}^β + f_{l−1}(h_{l−1}^β) − h_l^β)/β        l ≥ 1
    a_0 = (1/β) ∂E/∂h_0 |_{h^β} = (I + ∂f_0/∂h_0)ᵀ a_1                         (the force on the clamp;
          ∂f_0(x)ᵀ a_1 of the input's shape on the plain MLP, `_clamp_force`)
    with no blocks: a_0 = ∂CE/∂h_0 (there is nothing to relax)

docs/PROTOCOL.md writes the credit as the state displacement (h_l^free − h_l^β)/β. For a layered energy that
displacement is not the gradient: it accumulates the prediction errors below it,
δ_l = (I + ∂f_{l−1}) δ_{l−1} + r_{l−1}, so it tends to ≈ (I + J Jᵀ + …)·g_l (about l·g_l for
near-identity blocks) and is 0 at the clamped h_0. The prediction error −r_{l−1}/β is what tends to
g_l as β → 0, and it is exactly the signal the EP weight update uses, so it is the credit reported
here (tested: cos(a_l, g_l) > 0.99 per layer at small β).

Knobs (settings.options): "beta" β = 1, "steps" = 2 sweeps, "alpha" = 1, "tol" = 0 (always `steps`,
no host sync). The credit is carried as a (the residuals are −β·a by construction), so small β does
not lose it to the float32 cancellation in h_{l+1} − h_l − f_l(h_l) (the reason β = 10 was chosen
before). Measurements (MNIST-1D, d=256, L=4, batch 128, seed 42, 15 epochs, one thread):
  * relative residual (as `ep_residual`, checked by autograd on F) on test batch 0 at epochs
    0 / 5 / 10 / 15 of default training: steps 1: 7e-3 / 2e-2 / 0.23 / 0.53; steps 2: 1e-4 / 4e-4 /
    0.034 / 0.15; steps 3: 1e-4 / 2e-4 / 0.0095 / 0.069; steps 5: ≤ 3.5e-3; the previous solver
    (20 backtracking gradient steps in h, α = 0.5): 0.21 / 0.76 / 0.89 / 1.2, i.e. never near the
    equilibrium. Credit cosine to the converged credit at epoch 15: steps 2: 0.976, 3: 0.992, the
    previous solver 0.65.
  * logged ep_residual over training (train batches): steps 2 ≤ 0.016 per epoch; tol = 0.05
    (steps ≤ 4) uses 2.0 → 3.0 sweeps per step as training goes on, residual ≤ 0.004. Test accuracy
    0.707–0.708 both (BP 0.72; previous EP 0.659), Γ on test batch 0: 0.975 / 0.998.
  * time per step (benchmarks/method_speed.py): steps 2 ≈ 2.3–2.5× BP, steps 3 ≈ 3.1–3.3× BP, the
    previous solver ≈ 15× BP: hence steps = 2 under the ≤ 3× budget.
  * β = 10 relaxed to equilibrium does not train: the one-sided estimator is the gradient of
    (1/β)·min_h F ≈ CE − (β/2N²)·Σ_i Σ_l ‖∂ℓ_i/∂h_l‖², which rewards high-gain blocks; the stack
    stiffens and the relaxation stops converging (steps 2: ep_residual 0.01 → 3–10 by epoch 6,
    acc 0.616, Γ 0.49; steps 8: → 4.5, acc 0.591). The previous solver's truncation hid this.
    β = 2 / 3 (plain sweeps, 2 / 3 of them): acc 0.709 / 0.701, but ep_residual up to 0.1.
No gradient clipping: the EP estimator approximates the BP gradient.

On the member axis (K runs of one ResMLP, vit-mini or resnet-small shape, `member_gradients`):
the relaxation is the same
code (`_relax`) over a `_Chain` whose samples are indexed (K, N) instead of (N,): every per-sample
quantity (F_i, the step length, the L-BFGS pairs and γ, the acceptance mask) is per member and
sample, every batch-wide one (the scale, the tol test and its flag, the sweep count) per member.
Where it differs from the original (Scellier & Bengio 2017: a Hopfield-like energy over layered units
with symmetric weights and a hard-sigmoid ρ, a free phase relaxed to its fixed point, a nudged phase
with the squared error at strength β, the update (1/β)(ρ(u_i^β)ρ(u_j^β) − ρ(u_i^0)ρ(u_j^0))):
  * the energy is the residual network's own prediction errors, E = ½ Σ ‖h_{l+1} − h_l − f_l(h_l)‖²,
    whose free minimum is the feed-forward pass (E = 0): the free phase needs no relaxation and its
    term of the estimator vanishes, so only the nudged term is left.
  * the cost is β·CE of the readout, not β·½‖y − ŷ‖²; β = 1 by default (a deterministic sign).
  * the nudged equilibrium is solved by per-sample quasi-Newton sweeps in the residual coordinates
    (one backward per sweep), not by the network's own leaky dynamics; its residual is logged.
  * each block's parameters learn from −(1/β)∂E/∂θ at h^β, i.e. backprop of a_{l+1} through the
    block's two layers, not a two-factor Hebbian product per weight.
  * on the plain MLP (arch mlp: D_in → d → … → d → C, as their 784-500-10 nets, but with the
    model's activation — tanh, sigmoid, relu, … — not their hard sigmoid ρ) the layers are theirs,
    yet the energy is still the chain of prediction errors ½ Σ ‖h_{l+1} − f_l(h_l)‖², not their
    Hopfield energy ½ Σ ‖u‖² − ½ Σ W ρ(u)ρ(u) − Σ b ρ(u) with symmetric weights; the forward pass is
    its free minimum, there is no feedback weight at all, and the credit is backprop's at h^β.
    Tested: a_l → g_l (cos > 0.99 per sample, h_0 included) and the update → the BP gradient as
    β → 0 on a tanh 20-16-16-5 MLP (tests/test_plain_mlp_energy.py). The plain MLP trains lone.
Each block is called as often as in the lone step, so a resnet-small member's BatchNorm running
statistics move exactly as its lone run's.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..metrics import ce_gradient
from ..model.members import MemberNet, member_cross_entropy
from ..model.resmlp import ResidualMLP
from ..model.resnet import SmallResNet
from ..model.vit import ViTMini
from .recipe import Recipe
from .setting import PaperSetting, Reported
from .base import Method, refuse_dropout

DEFAULTS = {"beta": 1.0, "steps": 2, "alpha": 1.0, "tol": 0.0}


def _per_sample(t: torch.Tensor, lead: int = 1) -> torch.Tensor:
    """Σ over layers and features of a stacked (L, *S, …) tensor, per sample: S, the `lead`
    sample dims ((N,) lone, (K, N) on the member axis)."""
    return t.flatten(1 + lead).sum(-1).sum(0)


def rounding_margin(logits: torch.Tensor) -> torch.Tensor:
    """How far a sample's energy ℓ_i/N + (a quadratic) may rise in a trial step before the rise is
    more than rounding: 2¹⁰·eps·(1 + max_j |z_ij|)/N per sample, z the free logits (…, N, C).
    ℓ_i = logsumexp(z_i) − z_iy carries an absolute error of a few eps·max_j |z_ij| (and the
    logits' own, of that order times the readout's fan-in), so below this a test "F_i(trial) ≤ F_i"
    compares rounding, not energies: a confident sample's first step lowers F_i by ≈ ½β‖g_i‖²,
    which is ∝ ℓ_i² and far below it. Used by the diagnosis' relaxations (ep, pc)."""
    n = logits.shape[-2]
    return (2 ** 10 * torch.finfo(logits.dtype).eps / n) * (1 + logits.abs().amax(-1))


def float64_copy(model, x: torch.Tensor):
    """(model, x) in float64 for a credit the diagnosis must reproduce, and the dtype to return it
    in: a float64 copy of a float32/16 model (the model itself is left as it is) and x cast if it
    is floating (class labels or token ids are left alone)."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    if dtype != torch.float64:
        model = copy.deepcopy(model).to(torch.float64)
    return model, (x.to(torch.float64) if x.is_floating_point() else x), dtype


def _bound(energy: torch.Tensor, slack: float, margin: torch.Tensor | None) -> torch.Tensor:
    """The largest F_i/β a trial may reach and still be accepted: training's relative slack, plus
    the rounding margin where one is given (`rounding_margin`)."""
    bound = energy * slack
    return bound if margin is None else bound + margin


def _bcast(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-sample tensor (S = (N,) or (K, N)) shaped to broadcast against a stacked (L, *S, …) one."""
    return v.view((1,) + v.shape + (1,) * (like.dim() - 1 - v.dim()))


class _Chain:
    """How the relaxation reaches a lone model: samples (N,), batch-wide sums 0-d."""

    lead = 1

    def __init__(self, model):
        self.model, self.n_blocks = model, model.n_blocks

    def embed(self, x):
        return self.model.embed_input(x)

    def block(self, l: int, h):
        return self.model.blocks[l](h)

    @property
    def skip(self) -> bool:
        """Whether h_{l+1} = h_l + f_l(h_l) (a residual stream) rather than f_l(h_l) (the plain MLP)."""
        return self.model.residual

    def advance(self, h, f):
        """h_{l+1} = h_l + f_l(h_l), or f_l(h_l) alone on a network without a skip."""
        return self.model.advance(h, f)

    def readout(self, h):
        return self.model.readout(h)

    def ce(self, logits, y):
        """The CE whose gradient the sweeps take: the batch mean (the model's loss: BCE on a plain
        MLP built with loss = bce)."""
        return self.model.loss(logits, y)

    def ce_per_sample(self, logits, y):
        """ℓ_i/N, per sample."""
        return self.model.loss(logits, y, reduction="none") / y.shape[-1]

    def total(self, t):
        """Σ over the batch (and layers, for a stacked tensor) and every feature of t: 0-d."""
        return t.sum()


class _MemberChain(_Chain):
    """The same for K members (a `MemberNet`): samples (K, N); the CE is Σ_k of each member's
    mean (member k's gradient is its own mean's); batch-wide sums per member, (K, 1)."""

    lead = 2

    def __init__(self, net: MemberNet):
        self.net, self.n_blocks = net, net.n_blocks
        self.state_dims = 2 + len(net.stream_shape)          # a state (K, N, *stream_shape)

    def embed(self, x):
        return self.net.embed_input(x)

    def block(self, l: int, h):
        return self.net.block(l, h)

    skip = True                                              # the member axis is residual

    def advance(self, h, f):
        return h + f

    def readout(self, h):
        return self.net.readout(h)

    def ce(self, logits, y):
        return member_cross_entropy(logits, y).sum()

    def ce_per_sample(self, logits, y):
        k, n, c = logits.shape
        return F.cross_entropy(logits.reshape(k * n, c), y.reshape(k * n), reduction="none").view(k, n) / n

    def total(self, t):
        stacked = t.dim() > self.state_dims                  # stacked (L, K, N, …) or one (K, N, …)
        k = t.shape[1] if stacked else t.shape[0]
        per = t.transpose(0, 1) if stacked else t
        return per.reshape(k, -1).sum(-1, keepdim=True)


def _clamp_force(chain: _Chain, a1: torch.Tensor, vjp0: torch.Tensor) -> torch.Tensor:
    """a_0 = (1/β) ∂E/∂h_0 at h^β, the force on the clamped h_0: (I + ∂f_0)ᵀ a_1 on a residual
    stream, ∂f_0ᵀ a_1 (of the input's shape) on the plain MLP, whose h_0 = x has no skip to h_1.
    vjp0 = ∂f_0(h_0)ᵀ a_1."""
    return a1 + vjp0 if chain.skip else vjp0


_MEMORY = 5          # (s, y) pairs kept by the per-sample L-BFGS of the relaxation


@dataclass
class Relaxed:
    """`EP.relax`'s result at the nudged states h^β.

    free_logits: the free phase's logits (detached); h0: embed(x) with its graph; credit:
    a_1 … a_L (detached, a_{l+1} = −r_l/β); leaves: h_0^β … h_{L−1}^β as fresh leaves, with
    branches[l] = f_l(leaves[l]) and its graph (parameters included); h_last: h_L^β as a leaf and
    logits = readout(h_last) with its graph; scale: β‖∂CE/∂h_L(h^free)‖ (batch norm, 0-d; per
    member (K, 1) on the member axis); sweeps: how many changed the credit (same shape; all
    `steps` unless "tol" froze it)."""

    free_logits: torch.Tensor
    h0: torch.Tensor
    credit: list[torch.Tensor]
    leaves: list[torch.Tensor]
    branches: list[torch.Tensor]
    h_last: torch.Tensor
    logits: torch.Tensor
    scale: torch.Tensor
    sweeps: torch.Tensor


class EP(Method):
    reads_clip = False                  # its step clips nothing (settings.clip)
    name = "ep"
    paper = True
    member_archs = (ResidualMLP, ViTMini, SmallResNet)
    option_defaults = DEFAULTS
    # steps: each sweep is one forward and one backward through the blocks per batch; published
    # EP relaxations run tens to a few hundred, so 1000 (500× the default) bounds a plan, not a typo
    option_ranges = {"beta": (1e-12, math.inf), "steps": (1, 1000), "alpha": (1e-12, 1.0),
                     "tol": (0.0, 1.0)}
    option_help = {"beta": "nudging strength β of F = E + β·CE",
                   "steps": "forward–backward sweeps of the nudged relaxation",
                   "alpha": "first step length of the relaxation (per sample; halved if it raises F_i)",
                   "tol": "stop the sweeps once ‖∂F/∂r‖ < tol × its free-phase value (0: always `steps`)"}

    # the paper's own setting, for `creditaudit reproduce` (methods/setting.py)
    paper_setting = PaperSetting(
        citation="Scellier & Bengio 2017 (Frontiers in Computational Neuroscience)",
        code="bscellier/Towards-a-Biologically-Plausible-Backprop (commit cb73f76): train_model.py:104-113, "
             "model.py:59-66",
        dataset="mnist",
        width=500,
        blocks=1,
        activation="sigmoid",
        loss="ce",
        options={},
        epochs=25,
        recipe=Recipe(optimizer="sgd", lr=0.05, weight_decay=0.0, schedule="constant", batch_size=20,
                      citation="bscellier/Towards-a-Biologically-Plausible-Backprop train_model.py:104-113 "
                               "(batch 20, 25 epochs; per-layer lr 0.1 and 0.05)"),
        reported=Reported(2.37, "the paper's MNIST result as recalled: not read here", verified=False),
        bp=None,
        deviations=("the paper's number could not be read here: unverified; it is the error on "
                    "MNIST's 10 k validation split, not the test set",
                    "a feed-forward network relaxed on this tool's chain energy with cross-entropy at "
                    "the output; the paper relaxes a Hopfield-like network with symmetric weights, "
                    "hard-sigmoid units and a squared-error cost (20 free and 4 nudged steps, β = 0.5 "
                    "with a random sign)",
                    "one lr (0.05) for every layer; the reference uses 0.1 and 0.05 per layer",
                    "no bp baseline is reported in the paper"))

    def __init__(self, model, settings):
        super().__init__(model, settings)
        refuse_dropout(model, self.name, "its sweeps relax one fixed energy, evaluated anew at every "
                       "sweep and again for the update")
        opts = self.resolve_options(settings.options)
        self.beta, self.steps, self.alpha = float(opts["beta"]), int(opts["steps"]), float(opts["alpha"])
        self.tol = float(opts["tol"])
        self.opt = self.add_optimizer(self.embed_params() + self.trainable_block_params()
                                      + self.head_params())
        self._reset_log()

    # -- the nudged phase -------------------------------------------------------------------------
    def _forward(self, chain: _Chain, h0, f0, credit):
        """The states whose residuals are r_l = −β·credit[l] (credit None: the free phase, r = 0),
        each block on a fresh leaf of its input (the update's graph): returns (leaves h_1 … h_{L−1},
        their branches, h_L leaf, logits)."""
        leaves, branches = [], []
        h = chain.advance(h0, f0.detach())
        if credit is not None:
            h = h - self.beta * credit[0]
        for l in range(1, chain.n_blocks):
            leaf = h.detach().requires_grad_(True)
            f = chain.block(l, leaf)
            leaves.append(leaf)
            branches.append(f)
            h = chain.advance(leaf.detach(), f.detach())
            if credit is not None:
                h = h - self.beta * credit[l]
        h_last = h.detach().requires_grad_(True)
        return leaves, branches, h_last, chain.readout(h_last)

    def _chain(self, chain: _Chain, h0, f0, credit):
        """The same states as one connected graph from the leaf h_1 (the relaxation's sweeps):
        returns ([h_1 … h_L], logits)."""
        h = chain.advance(h0, f0.detach())
        if credit is not None:
            h = h - self.beta * credit[0]
        states = [h.detach().requires_grad_(True)]
        for l in range(1, chain.n_blocks):
            h = chain.advance(states[-1], chain.block(l, states[-1]))
            if credit is not None:
                h = h - self.beta * credit[l]
            states.append(h)
        return states, chain.readout(states[-1])

    @staticmethod
    def _sweep(chain: _Chain, states, logits, y) -> torch.Tensor:
        """T(a) = ∂CE/∂h_l at the chain's states, l = 1 … L, stacked (L, N, …): one backward
        (input gradients only) gives T_L = ∂CE/∂h_L and T_l = (I + ∂f_l)ᵀ T_{l+1}."""
        return torch.stack(torch.autograd.grad(chain.ce(logits, y), states))

    def _energy(self, chain: _Chain, credit, logits, y) -> torch.Tensor:
        """F_i/β per sample at the states whose residuals are r = −β·credit (stacked (L, N, …)):
        ½β‖a_i‖² + ℓ_i/N."""
        return 0.5 * self.beta * _per_sample(credit * credit, chain.lead) + chain.ce_per_sample(logits, y)

    @staticmethod
    def _direction(step, pairs, gamma):
        """The L-BFGS direction H·d per sample: two-loop recursion over the stored (s, y, ρ) pairs
        (newest last; ρ = 0 marks a pair a sample did not take) with H_0 = γ_i·I (γ per sample,
        of the sample dims' shape). With no pair it is d itself (γ = 1): the plain sweep."""
        q, coef, lead = step, [], gamma.dim()
        for s, yv, rho in reversed(pairs):
            c = rho * _per_sample(s * q, lead)
            q = q - _bcast(c, q) * yv
            coef.append(c)
        q = _bcast(gamma, q) * q
        for (s, yv, rho), c in zip(pairs, reversed(coef)):
            q = q + _bcast(c - rho * _per_sample(yv * q, lead), q) * s
        return q

    def relax(self, x, y) -> Relaxed:
        """The free phase and `steps` forward–backward sweeps to the nudged equilibrium (module
        docstring): per-sample quasi-Newton steps on F in the residual coordinates, a step that
        raises a sample's F_i rejected and its step length halved. The forward at the final
        credit keeps the parameters' graph, for the update."""
        return self._relax(_Chain(self.model), x, y)

    def _relax(self, chain: _Chain, x, y, with_margin: bool = False) -> Relaxed:
        """`relax` through `chain`: the lone model, or K members at once (`_MemberChain`).

        with_margin: accept a trial whose F_i rose by no more than the rounding error of F_i
        itself, `rounding_margin` (the diagnosis' relaxation, `credit`); False keeps training's
        strict test (F_i ≤ F_i·(1 + 16 eps)), so a run computes what it always did."""
        with torch.enable_grad():
            h0 = chain.embed(x)
            h0_leaf = h0.detach().requires_grad_(True)
            f0 = chain.block(0, h0_leaf)
            clamp = h0_leaf.detach()
            states, logits = self._chain(chain, clamp, f0, None)         # the free phase, a = 0
            free_logits = logits.detach()
            energy = chain.ce_per_sample(free_logits, y).detach()
            step = self._sweep(chain, states, logits, y)                 # d(0) = T(0), (L, N, …)
            scale = self.beta * chain.total(step[-1].pow(2)).sqrt()
            credit = torch.zeros_like(step)
            length = torch.full_like(energy, self.alpha)                 # per-sample step length
            pairs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
            gamma = torch.ones_like(energy)                              # H_0 = γ·I, γ ≤ 1
            slack = 1 + 16 * torch.finfo(h0.dtype).eps
            margin = rounding_margin(free_logits) if with_margin else None
            first = chain.total(step.pow(2))
            active = torch.ones(first.shape, dtype=torch.bool, device=h0.device)  # tol not reached yet
            sweeps = torch.zeros(first.shape, device=h0.device)
            for k in range(self.steps):
                trial = credit + _bcast(length, step) * self._direction(step, pairs, gamma)
                sweeps = sweeps + active
                if self.tol > 0 and k > 0:       # converged: this sweep is the last that moves a
                    now = active
                    active = active & (chain.total(step.pow(2)) > self.tol ** 2 * first)
                else:
                    now = active
                if k == self.steps - 1:                                  # the last trial: accept or
                    with torch.no_grad():                                # keep, sample by sample
                        _, logits = self._chain(chain, clamp, f0, trial)
                        ok = self._energy(chain, trial, logits, y) <= _bound(energy, slack, margin)
                    credit = torch.where(_bcast(ok & now, step), trial, credit)
                    break
                states, logits = self._chain(chain, clamp, f0, trial)
                new_energy = self._energy(chain, trial, logits, y).detach()
                ok = (new_energy <= _bound(energy, slack, margin)) & now  # F_i did not go up
                new_step = self._sweep(chain, states, logits, y) - trial  # d = T(a) − a ∝ −∂F/∂r
                keep = _bcast(ok, step)
                s = torch.where(keep, trial - credit, 0.0)
                yv = torch.where(keep, step - new_step, 0.0)             # Δ(∂F/∂a)/β² = −Δd
                sy = _per_sample(s * yv, chain.lead)
                took = ok & (sy > 0)                                     # curvature condition
                pairs = (pairs + [(s, yv, torch.where(took, 1 / sy, 0.0))])[-_MEMORY:]
                gamma = torch.where(took, sy / _per_sample(yv * yv, chain.lead).clamp_min(
                    torch.finfo(sy.dtype).tiny), gamma).clamp(max=1.0)
                credit = torch.where(keep, trial, credit)
                step = torch.where(keep, new_step, step)
                energy = torch.where(ok, new_energy, energy)
                length = torch.where(ok, 1.0, length / 2)
            fwd = self._forward(chain, clamp, f0, credit)                # the update's graph
        leaves, branches, h_last, logits = fwd
        return Relaxed(free_logits, h0, list(credit.detach().unbind(0)), [h0_leaf] + leaves,
                       [f0] + branches, h_last, logits, scale.detach(), sweeps)

    # -- the update and the credit ------------------------------------------------------------------
    def gradients(self, x, y):
        if not self.model.n_blocks:
            return self._shallow_gradients(x, y)
        rel = self.relax(x, y)
        a = rel.credit                                                      # a_1 … a_L
        # One backward: head CE at h_L^β, the local loss Σ_i a_{l+1,i}·f_l(h_l^β)_i of every block.
        # Gradients go to the trainable blocks and the head only; the leaves' gradients are the VJPs
        # ∂f_lᵀ a_{l+1} at h^β — the clamp's force (a_0) and the stationarity check.
        total = self.model.loss(rel.logits, y)
        for f, al in zip(rel.branches, a):
            total = total + (f * al).sum()
        params = self.trainable_block_params() + self.head_params()
        grads = torch.autograd.grad(total, params + rel.leaves + [rel.h_last], allow_unused=True)
        leaf_grads, grad_last = grads[len(params):-1], grads[-1]
        a0 = _clamp_force(_Chain(self.model), a[0], leaf_grads[0])          # (I + ∂f_0)ᵀ a_1
        embed = self.embed_params()
        grads = grads[:len(params)] + (torch.autograd.grad(rel.h0, embed, a0, allow_unused=True)  # embed
                                       if embed else ())                  # (the plain MLP has none)
        for p, g in zip(params + embed, grads):
            p.grad = g
        self._step_log = self._log(_Chain(self.model), rel, leaf_grads[1:], grad_last)
        return self.model.loss(rel.free_logits, y).detach()

    def member_gradients(self, stack, x, y):
        """The lone step per member (`_MemberChain`): each member's relaxation, acceptance and tol
        flag its own; the update's gradients for every block some member trains (a member's
        frozen slices are masked by the stack; EP clips nothing, so they touch nothing else)."""
        net = stack.net
        if not net.n_blocks:                    # nothing to relax: BP's step, as `_shallow_gradients`
            ce = member_cross_entropy(net.readout(net.embed_input(x)), y)
            ce.sum().backward()
            return ce.detach()
        chain = _MemberChain(net)
        rel = self._relax(chain, x, y)
        a = rel.credit
        total = chain.ce(rel.logits, y)
        for f, al in zip(rel.branches, a):
            total = total + (f * al).sum()
        params = [p for l in stack.trained for p in net.block_params(l)] + net.head_params()
        grads = torch.autograd.grad(total, params + rel.leaves + [rel.h_last], allow_unused=True)
        leaf_grads, grad_last = grads[len(params):-1], grads[-1]
        a0 = a[0] + leaf_grads[0]                                           # (I + ∂f_0)ᵀ a_1
        embed = net.embed_params()
        grads = grads[:len(params)] + torch.autograd.grad(rel.h0, embed, a0, allow_unused=True)
        for p, g in zip(params + embed, grads):
            p.grad = g.contiguous()      # a bmm's weight gradient may come strided: AdamW wants the layout of p
        stack.log.ep = self._log(chain, rel, leaf_grads[1:], grad_last)
        return member_cross_entropy(rel.free_logits, y).detach()

    def member_after_step(self, stack):
        """Each member's (ratio, sweeps) into its lone Method's epoch sums, as `apply_gradients`."""
        step_log = getattr(stack.log, "ep", None)
        if step_log is not None:                 # None: shallow members, nothing relaxed
            ratio, sweeps = step_log
            for k, method in enumerate(stack.methods):
                method._accumulate(ratio[k, 0], sweeps[k, 0])

    def _shallow_gradients(self, x, y):
        """No blocks: nothing to relax; a_0 = ∂CE/∂h_0 and the step is BP's."""
        loss = self.model.loss(self.model(x), y)
        loss.backward()
        return loss.detach()

    def credit(self, x, y):
        """a_0 … a_L (module docstring) from the relaxation that the diagnosis can reproduce: in
        float64, on a float64 copy of the model, with the rounding-margin acceptance test
        (`_relax`), returned in the model's dtype. Training's float32 test decides a confident
        sample's trials by rounding (its F_i moves by ≈ ½β‖g_i‖², far below F_i's rounding
        error), so such a sample kept a = 0 or took its steps by the last bits of the weights
        and of the reduction order; Γ, a mean of per-sample cosines, then moved by 1/N per
        sample whose decision flipped (docs/PROTOCOL.md §3.13). `trained_credit` is the credit as
        the step computes it."""
        model, x, dtype = float64_copy(self.model, x)
        return [a.to(dtype) for a in self._relaxed_credit(model, x, y, with_margin=True)]

    def trained_credit(self, x, y):
        """a_0 … a_L exactly as a training step relaxes them: the model itself, in its own dtype,
        with training's strict acceptance test (F_i ≤ F_i·(1 + 16 eps)) — the credit the blocks
        learn from (in the mode the caller left the model in; the diagnosis sets eval). The
        diagnosis reports its Γ beside `credit`'s (docs/PROTOCOL.md §3.13)."""
        return self._relaxed_credit(self.model, x, y, with_margin=False)

    def _relaxed_credit(self, model, x, y, with_margin: bool) -> list[torch.Tensor]:
        """[a_0 … a_L] (detached) of `_relax` on `model` (a_0 the clamp's force, `_clamp_force`)."""
        if not model.n_blocks:
            return [ce_gradient(model.readout, model.embed_input(x), y)[1]]
        chain = _Chain(model)
        rel = self._relax(chain, x, y, with_margin=with_margin)
        with torch.enable_grad():
            (vjp0,) = torch.autograd.grad(rel.branches[0], rel.leaves[0], rel.credit[0])
        return [a.detach() for a in [_clamp_force(chain, rel.credit[0], vjp0)] + rel.credit]

    # -- convergence log ----------------------------------------------------------------------------
    def _log(self, chain: _Chain, rel: Relaxed, vjps, grad_last):
        """This step's ‖∂F/∂h(h^β)‖/‖∂F/∂h(h^free)‖ and sweep count, as device tensors (no host
        sync); `apply_gradients` adds them to the epoch's sums, eagerly: the step only writes
        fresh tensors, so a compiled (CUDA-graph) step never reads last step's outputs.

        With a = −r/β: ∂F/∂h_l = −β (a_l − a_{l+1} − ∂f_lᵀ a_{l+1}) (−β (a_l − ∂f_lᵀ a_{l+1})
        without a skip), ∂F/∂h_L = β (∂CE/∂h_L − a_L).
        Returns (ratio, sweeps), per member on the member axis."""
        with torch.no_grad():
            a = rel.credit
            sq = chain.total((grad_last - a[-1]).pow(2))
            for l, vjp in enumerate(vjps, start=1):
                back = vjp + a[l] if chain.skip else vjp                    # (I + ∂f_l)ᵀ a_{l+1}, or ∂f_lᵀ a_{l+1}
                sq = sq + chain.total((a[l - 1] - back).pow(2))
            ratio = self.beta * sq.sqrt() / rel.scale.clamp_min(torch.finfo(rel.scale.dtype).tiny)
            return ratio, rel.sweeps

    def apply_gradients(self):
        super().apply_gradients()
        if self._step_log is not None:
            ratio, sweeps = self._step_log
            self._step_log = None
            self._accumulate(ratio, sweeps)

    def _accumulate(self, ratio: torch.Tensor, sweeps: torch.Tensor) -> None:
        """One step's residual ratio and sweep count into the epoch's sums (device tensors)."""
        self._res_sum = ratio.double() if self._res_sum is None else self._res_sum + ratio
        self._sweep_sum = self._sweep_sum + sweeps
        self._count += 1

    def _reset_log(self) -> None:
        self._step_log: tuple[torch.Tensor, torch.Tensor] | None = None
        self._res_sum: torch.Tensor | None = None
        self._sweep_sum, self._count = 0, 0

    def epoch_log(self) -> dict[str, float]:
        """{"ep_residual": mean relative stationarity residual at h^β, "ep_steps": mean sweeps}
        over the steps since the last call (module docstring); empty when no step was taken."""
        if not self._count:
            return {}
        out = {"ep_residual": float(self._res_sum) / self._count,
               "ep_steps": float(self._sweep_sum) / self._count}
        self._reset_log()
        return out
