"""local-loss — local (layer-wise) classifiers: every block learns from an auxiliary classifier on its
own output (Belilovsky, Eickenberg & Oyallon 2019, "Greedy layerwise learning can scale to ImageNet":
plain local CE; Nøkland & Eidnes 2019, "Training neural networks with local error signals": their
'pred' loss, the local CE alone, is what the audit trains by default (sim = 0); their 'predsim' adds
similarity matching, option sim = 0.99).

Auxiliary classifier at position l = 0 … L−1 on a residual stream (one per block output below the
top, and one at h_0 for the embedding), at l = 1 … L−1 on the plain MLP (arch mlp: every hidden layer
below the top; none at h_0 = x, which has no parameters to train), on the flattened state of
D_l = prod(position_shape(l)) values (each head sized by its own position):

    z_l      = LN(h_l)                               parameter-free LayerNorm over the D_l values
             = h_l                                   on the plain MLP (its layers' outputs, as theirs)
    p_l      = A_l z_l + c_l                         Linear(D_l, C), its own parameters (aux head l;
                                                     A_l = 0 at init on the plain MLP, as their decoder_y)
    ℓ_aux,l  = (1 − β) · CE(p_l, y) + β · L_sim(z_l, y)                 β = option `sim`; mean over the batch
    L_sim    = mean_{i,j} (S(z)_{ij} − S(Y)_{ij})²                       over all N² pairs (the reference's mse)
    S(x)_{ij} = clamp(⟨x̂_i, x̂_j⟩, −1, 1),  x̂_i = (x_i − mean(x_i)) / (‖x_i − mean(x_i)‖ + 1e-8)
              (Nøkland & Eidnes' `similarity_matrix`: each sample centred over its own features, then
              unit-normalised — a cosine of centred vectors), Y = onehot(y)

so S(Y)_{ij} = 1 for two samples of one class and −1/(C − 1) for two of different classes (the
centred one-hots), not 0. β = 0 is plain local CE (Belilovsky et al.); β = 0.99 is predsim as
published (anokland/local-loss: `--loss-sup predsim`, `--beta 0.99`); β = 1 is their "sim" loss
alone. At the top, h_L, the local classifier is the model's own readout, so block L−1 learns from
the true CE.

Where it differs from the original, and why:
  * Nøkland & Eidnes take the similarity matrix of a learned projection of the layer's output (a
    bias-free Linear(D, D) in their MLPs, a 3×3 conv followed by the per-channel standard deviation
    over space in their conv nets); here it is taken on the parameter-free normalised state z_l itself,
    for every stream shape (a D × D projection is out of reach for a feature-map stream), so the
    similarity term shapes the block's output directly and the aux head stays one Linear.
  * on a residual stream the classifier reads LN(h_l) (the stream is unnormalised) through torch's
    default init; theirs reads the layer's output (Linear → BatchNorm → nonlinearity) through a
    zero-initialised Linear, which the plain MLP follows (z_l = h_l, A_l = 0), without the BatchNorm.
  * on a residual stream "layer" is a residual block: block l learns from the classifier at its
    output h_{l+1} = h_l + f_l(h_l), through the skip too. On the plain MLP a block is their layer
    (Linear → activation); the top hidden layer h_L learns from the model's readout, where theirs
    has its own local classifier and a separate output layer trained on its detached input: the same
    loss, one Linear(d, C) each, so they differ only in the classifier's init.
  * the recipe is theirs (`recipe`: Adam lr 5e-4, weight decay 0, lr × 0.25 at 50 / 75 / 89 / 94 %
    of the run, batch 128), as one optimiser with a parameter group per block plus one for all aux
    heads — Adam is per parameter, so this is their per-layer Adam — but with the per-block gradient
    clip at settings.clip, which theirs does not have. Their MNIST MLP commands (anokland/local-loss
    README) train a 3-hidden-layer MLP of 1024 units (`--num-layers 3`, `--num-hidden` default 1024)
    with leaky ReLU (slope 0.01), `--dropout 0.1` and 100 epochs: here `arch mlp, blocks 3,
    width 1024`, `dropout 0.1`, with relu (no leaky ReLU among the activations) or another
    activation. Their dropout acts on the layer's output after its local loss was read; the plain
    MLP's acts inside the block, so the local classifier reads the dropped-out output. Their label
    smoothing and the 'bio' variants are not used.

Credit, in per-sample units (N · ∂/∂h of the mean loss, the units of ∂ℓ_i/∂h_i; "direction of
increasing loss", like every method):

    a_l = N · ∂ℓ_aux,l/∂h_l          l = 0 … L−1     (h_l detached: the aux head's own loss)
    a_L = ∂ℓ_i/∂h_L                   the readout's CE (exact: the top classifier is the model's)
    with no blocks: a_0 = ∂ℓ_i/∂h_0
    plain MLP: a_0 = ∂f_0(x)ᵀ a_1     what block 0's local loss sends to the input (`local.input_credit`;
                                     nothing trains with it, the step passes 0 there)

so Γ_l compares the local classifier's gradient ∂ℓ_aux/∂h_l with the true ∂CE/∂h_l (the greedy
objective against the end-to-end one), and ρ asks whether the local gradient predicts how the
network's loss changes.

Updates (`LocalMethod.local_gradients`, per-block clip at settings.clip):

    block l:  (f_l(h_l.detach()) · a_{l+1}).sum(-1).mean()   = ℓ_aux,l+1's gradient in block l's
              parameters (h_{l+1} = h_l.detach() + f_l(h_l.detach()): the block is trained greedily
              on the classifier at its output)
    embed:    (embed(x) · a_0).sum(-1).mean()                = ℓ_aux,0's gradient in the embedding
    head:     CE(readout(h_L.detach()), y)
    aux head l: ∂ℓ_aux,l/∂(A_l, c_l) at h_l.detach()          own optimiser (the run's recipe)

All of it from one forward (`local_forward`), one input-and-aux-parameter gradient call and the local
update's backward. The aux heads are initialised from the method's generator (not the global RNG)
and saved in the checkpoint (`extra_state`), so a resumed run continues bit-identically.

Options: "sim" = β ∈ [0, 1], the weight of the similarity-matching term (default 0: plain local CE as
in Belilovsky et al.; 0.99: predsim as published; 1: sim alone).

Measured (MNIST-1D, d = 256, L = 4, batch 128, seed 42, one thread, 5 epochs, sim = 0): test accuracy
0.536 (bp 0.610), Γ per layer on test batch 0 0.13 / 0.22 / 0.18 / 0.13 / 1.00 (the top credit is
the true gradient), CPU time per epoch 1.0 s (bp 0.79 s). On digits (d = 32, L = 2) the greedy
classifiers lag early (0.61 after 6 epochs, bp 0.90) and catch up (0.95 after 20).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .local import LocalMethod, input_credit
from .recipe import Recipe, step_at
from .setting import PaperSetting, Reported


def similarity_matrix(x: torch.Tensor) -> torch.Tensor:
    """S_ij = clamp(⟨x̂_i, x̂_j⟩, −1, 1), x̂_i = x_i centred over its own features and unit-normalised,
    x (N, D) → (N, N): Nøkland & Eidnes' adjusted cosine similarity."""
    centred = x - x.mean(-1, keepdim=True)
    unit = centred / (centred.norm(dim=-1, keepdim=True) + 1e-8)
    return (unit @ unit.T).clamp(-1, 1)


def similarity_loss(z: torch.Tensor, y: torch.Tensor, n_classes: int) -> torch.Tensor:
    """L_sim = mean_{i,j} (S(z)_{ij} − S(onehot(y))_{ij})², z flattened per sample (N, D); S(onehot)
    is 1 within a class and −1/(C − 1) across classes."""
    target = similarity_matrix(F.one_hot(y, n_classes).to(z.dtype))
    return (similarity_matrix(z) - target).pow(2).mean()


class LocalLosses(LocalMethod):
    name = "local-loss"
    summary = "local (layer-wise) classifiers (Belilovsky et al. 2019; Nøkland & Eidnes 2019): every block learns from an auxiliary classifier on its own output; option sim = β weighs in similarity matching, 0.99 = predsim"
    # Adam lr 5e-4, no weight decay, lr × 0.25 at epochs 50, 75, 89, 94 of 100, batch 128
    recipe = Recipe(
        optimizer="adam", lr=5e-4, weight_decay=0.0, schedule="step",
        milestones=step_at((50, 75, 89, 94), of=100), gamma=0.25, batch_size=128,
        citation="Nøkland & Eidnes 2019 (ICML) and their reference code anokland/local-loss: train.py "
                 "(--optim adam, --lr-decay-fact 0.25, --batch-size 128, weight decay 0) with its MNIST "
                 "MLP commands (--lr 5e-4 --epochs 100 --lr-decay-milestones 50 75 89 94)")
    null_note = ("nothing random in its credit, no null; Γ compares the auxiliary classifiers' "
                 "gradients with the end-to-end one")
    option_defaults = {"sim": 0.0}
    option_ranges = {"sim": (0.0, 1.0)}
    option_help = {"sim": "β, the weight of the similarity-matching term against (1 − β) on the local "
                          "CE: 0 = plain local CE (Belilovsky et al.), 0.99 = predsim (Nøkland & Eidnes)"}

    # the paper's own setting, for `creditaudit reproduce` (methods/setting.py)
    paper_setting = PaperSetting(
        citation="Nøkland & Eidnes 2019 (ICML)",
        code="anokland/local-loss (commit 7b3b40b): run_experiments.sh:3, train.py:471-520",
        dataset="mnist",
        width=1024,
        blocks=3,
        activation="relu",
        loss="ce",
        dropout=0.1,
        options={},
        epochs=100,
        recipe=Recipe(optimizer="adam", lr=5e-4, weight_decay=0.0, schedule="step",
                      milestones=(0.5, 0.75, 0.89, 0.94), gamma=0.25, batch_size=128,
                      citation="anokland/local-loss run_experiments.sh:3 (Adam, lr 5e-4 × 0.25 at epochs "
                               "50, 75, 89, 94, batch 128, 100 epochs)"),
        reported=Reported(0.68, "README.md:23 of the reference code, 'Results on MNIST with 2 pixel "
                                "jittering', row mlp, column pred"),
        bp=Reported(0.75, "README.md:23 of the reference code, the same row, global loss"),
        deviations=("no BatchNorm before each nonlinearity: the plain MLP has none (train.py:471-520 "
                    "uses it)",
                    "no 2-pixel jitter augmentation; the README's numbers are with it",
                    "the audited variant is pred (a local classifier per layer); the README's "
                    "best MLP number is predsim's 0.62 %"))

    def __init__(self, model, settings):
        super().__init__(model, settings)
        self.sim = float(self.option(settings.options, "sim"))     # a Python number, read once
        self.plain = not model.residual
        # the positions with a local classifier: 0 … L−1 on a residual stream (h_0 trains the
        # embedding), 1 … L−1 on the plain MLP (h_0 is the input: nothing to train there)
        self.positions = tuple(range(1 if self.plain else 0, model.n_blocks))
        self.d_flat = {l: math.prod(model.position_shape(l)) for l in self.positions}
        with torch.random.fork_rng(devices=[]):  # built on the CPU from the method's generator only
            torch.default_generator.manual_seed(int(torch.randint(2 ** 62, (1,), generator=self.gen)))
            self.aux = nn.ModuleList(nn.Linear(self.d_flat[l], model.n_classes)
                                     for l in self.positions)                         # A_l, c_l
        if self.plain:                    # Nøkland & Eidnes' decoder_y starts at zero (train.py)
            with torch.no_grad():
                for head in self.aux:
                    head.weight.zero_()
        like = model.head_parameters()[0]
        self.aux.to(device=like.device, dtype=like.dtype)
        self.opt = self.add_optimizer(self.local_param_groups())
        self.aux_opt = self.add_optimizer(self.aux.parameters()) if self.positions else None

    def _aux_loss(self, i: int, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """ℓ_aux at the state h (N, …) of the i-th classified position, mean over the batch."""
        z = h.flatten(1)
        if not self.plain:
            z = F.layer_norm(z, z.shape[-1:])                                         # z_l = LN(h_l)
        loss = F.cross_entropy(self.aux[i](z), y)
        if self.sim:
            loss = (1 - self.sim) * loss + self.sim * similarity_loss(z, y, self.model.n_classes)
        return loss

    def _credit(self, hidden, y, with_aux: bool):
        """[a_0 … a_L] at the detached states `hidden`; with_aux: also the aux heads' gradients.
        On the plain MLP a_0 is left 0 here (nothing trains with it); `credit` fills it in."""
        n = len(y)
        with torch.enable_grad():
            leaves = [h.detach().requires_grad_(True) for h in hidden]
            total = self.model.loss(self.model.readout(leaves[-1]), y)                # a_L: the readout
            for i, l in enumerate(self.positions):
                total = total + self._aux_loss(i, leaves[l], y)
            params = list(self.aux.parameters()) if with_aux else []
            grads = torch.autograd.grad(total, leaves + params, allow_unused=True)
        for p, g in zip(params, grads[len(leaves):]):
            p.grad = g
        return [torch.zeros_like(h) if g is None else n * g                     # per-sample units
                for h, g in zip(hidden, grads[:len(leaves)])]

    def gradients(self, x, y):
        fwd = self.local_forward(x)
        credit = self._credit(fwd.hidden, y, with_aux=True)
        return self.local_gradients(y, fwd, credit)

    def credit(self, x, y):
        with torch.no_grad():
            _, hidden = self.model(x, return_hidden=True)
        credit = self._credit(hidden, y, with_aux=False)
        if self.plain:                                        # a_0 = ∂f_0(x)ᵀ a_1 (local.input_credit)
            credit[0] = input_credit(self.model, x, credit[1])
        return credit

    def exact_positions(self, n_blocks):
        """{L}: no auxiliary loss reads h_L, so a_L = N·∂CE/∂h_L, the readout's own gradient."""
        return frozenset({n_blocks})

    def extra_state(self):
        return {"aux": dict(self.aux.state_dict())}

    def load_extra_state(self, state):
        self.aux.load_state_dict(state["aux"])
