"""The forward-gradient family — gradients from one forward-mode directional derivative, no backward
pass through the stack: fg-w (weight perturbation; Baydin, Pearlmutter, Syme, Wood & Torr 2022,
"Gradients without backpropagation"), fg-a and lg-fg-a (activity perturbation, global and local-greedy;
Ren, Kornblith, Liao & Hinton, ICLR 2023, "Scaling forward gradient with local losses").

The estimator (all three). For a loss J and a tangent v ~ N(0, I) over the inputs z of J, forward-mode
AD gives the directional derivative d = ∇J · v in one forward pass (`torch.func.jvp`), and

    ĝ = d · v,      E[ĝ] = E[v vᵀ] ∇J = ∇J          (unbiased)

but one draw is far from ∇J: cos(ĝ, ∇J) = |⟨∇J, v⟩| / (‖∇J‖ ‖v‖), whose mean is ≈ √(2/π)/√n for n
dimensions (⟨∇J, v⟩/‖∇J‖ ~ N(0, 1), E|N(0, 1)| = √(2/π), ‖v‖ ≈ √n). The variance grows with n, which
is why Ren et al. move the tangent from the weights (n = all parameters) to the activations (n = the
features of one sample's state) and then to local losses (each block's estimate sees only its own
tangent).

    fg-w     v over the trainable parameters θ (the embedding and each trainable block; the readout
             trains on its exact CE gradient, as in Ren et al.'s code):
                 d   = ∂J/∂θ · v,   J = mean_i ℓ_i                    one jvp of the model's loss
                 g_θ = d · v                                           the update's gradient
    fg-a     a tangent u_{l,i} ~ N(0, I_D) per sample at every position h_l (h_0 … h_L; h_1 … h_L on the
             plain MLP, whose h_0 is the input), one jvp of the per-sample loss through the whole
             network perturbed at every position at once (Ren et al.'s one forward pass):
                 d_i     = Σ_k ⟨∂ℓ_i/∂h_{k,i}, u_{k,i}⟩
                 a_{l,i} = d_i · u_{l,i}                               E[a_l] = ∂ℓ_i/∂h_l
             and block l learns from a_{l+1} through its own local backward
             (`LocalMethod.local_gradients`: (f_l(h_l.detach()) · a_{l+1}).sum(-1).mean()).
    lg-fg-a  as fg-a, but the tangent at h_l measures the derivative of a local loss read at h_l alone
             (the blocks are separated by stop-gradients, so each local loss sees only its own tangent):
                 ℓ_aux,l = CE(A_l LN(h_l) + c_l, y)    l < L (LN parameter-free; z = h_l on the plain MLP)
                 ℓ_aux,L = the model's own loss at the readout
                 d_{l,i} = ⟨∂ℓ_aux,l,i/∂h_{l,i}, u_{l,i}⟩,  a_{l,i} = d_{l,i} · u_{l,i}
                                                              E[a_l] = ∂ℓ_aux,l,i/∂h_l (the local gradient)
             the classifiers (A_l, c_l) train on their exact gradients (as Ren et al.'s local heads).
             The local classifiers are local-loss's (`methods/local_losses.py`, sim = 0).

fg-a is node perturbation's σ → 0 limit (`methods/node_perturbation.py`: a_l = ΔL ξ_l/σ², ξ = σu,
ΔL/σ → Σ_k ⟨g_k, u_k⟩) with the exact directional derivative in place of the finite difference, so its
chance Γ is node perturbation's: E[Γ_l] ≈ √(2/π)·‖g_l‖/(√D·√(Σ_k ‖g_k‖²)) (`node_perturbation.chance_gamma`).
For lg-fg-a each position's estimate has its own derivative: E[Γ_l] against its own local gradient is
√(2/π)/√D; against the true gradient it is further scaled by the cosine of the two.

Credit a_l (what the audit measures; "direction of increasing loss", per-sample units ∂ℓ_i/∂h_l):
  fg-a, lg-fg-a: the estimate above — exactly what the step trains the blocks with. On the plain MLP
  a_0 = ∂f_0(x)ᵀ a_1 (`local.input_credit`; nothing trains with it).
  fg-w: weight perturbation has no activity credit of its own. Reported is the push-forward of the
  step's estimate to the state: with t_{l,i} = ∂h_{l,i}/∂θ · v (the tangent the weight tangent sends to
  h_l, from the same jvp) and d_i = ∂ℓ_i/∂θ · v,
      a_{l,i} = d_i · t_{l,i},     E[a_{l,i}] = K_{l,i} g_{l,i},   K_{l,i} = (∂h_{l,i}/∂θ)(∂h_{l,i}/∂θ)ᵀ
  (only the parameters below h_l move it), i.e. the direction (up to −lr) in which the estimated weight
  step moves sample i's state. Even in expectation it is the tangent kernel K_l applied to g_l, not
  g_l: fg-w's Γ asks whether its step moves the states along the BP gradient, and an exact gradient
  step would score cos(K g, g) < 1 there too. On the plain MLP a_0 = 0 (the input does not move).

Γ's null: `random_feedback = True` with the tangents as the random draws — `fresh_feedback_credit`
is the same estimator under fresh tangents from the audit's generator. So the null is the spread of
Γ over tangent draws, the one-draw chance level (≈ √(2/π)/√D per position): Γ − null ≈ 0 is what an
unbiased one-draw estimate scores; the estimate is unbiased, but one draw is not its expectation.
lg-fg-a's a_l has cos(a_l, ∂ℓ_aux,l/∂h_l) = |⟨g, u⟩|/(‖g‖‖u‖) ≥ 0 (each position its own derivative);
fg-a's derivative is shared by every position's tangent, so its per-position cosine can be negative.

exact_positions: none. Every position's credit is a one-draw estimate (lg-fg-a's a_L estimates the
readout's gradient, fg-w's a_L is a push-forward), so Γ_l = 1 nowhere by construction.

Draws: `prepare_step` draws the step's tangents from the method's generator `self.gen` on the CPU
(`seeding.draw_on_host`, no host sync, the same numbers on any device), so a step is reproducible from
the seed and a resumed run continues the stream; `gradients` draws nothing. `credit` (the audit's a_l)
draws from a generator rebuilt from a seed kept in the method's state: reproducible, and it does not
advance the training stream.

Compilation: none — the steps train eagerly (`JVP_COMPILES`, below).

Architectures: the ResMLP (`arch resmlp`) and the plain MLP (`arch mlp`), without dropout (the jvp pass
must compute the same function as the clean pass). Others are refused in one line: their BatchNorm
(resnet-small) would need the jvp pass to leave running statistics alone, and nobody has checked
the token stream (vit-mini) here. No member axis.

Where it differs from the original:
  fg-w (Baydin et al. 2022; their MNIST MLP recipe as orobix/fwdgrad configures it):
    * the readout trains on its exact CE gradient; Baydin et al. perturb every parameter. Ren et al.'s
      code does as we do (their readout's gradient is exact in every forward-gradient variant);
    * no gradient clip (as theirs; settings.clip is not used): the published lr 2e-4 is sized for the
      raw estimate, whose norm is ≈ ‖∇J‖·√n — clipped to 1 per block, a step would be 2e-4 long;
    * their learning rate decays per iteration, lr_i = lr_0·e^(−k·i) (k = 1e-4); the recipe here is
      constant (no exponential schedule in `Recipe`): over their 938 iterations per MNIST epoch that
      is a factor 0.91 per epoch they have and we do not;
    * θ is every parameter of the embedding and of each trainable block (frozen blocks get no tangent:
      the frozen control must leave them bit-identical).
  fg-a (Ren et al. 2023, FG-A):
    * the tangent sits on the residual stream / each hidden layer's output h_{l+1}, and the block's
      weights learn by backprop of a_{l+1} inside the block (W1 through W2 in a ResMLP block). Ren et
      al. perturb every layer's pre-activation (after its normalisation, before the ReLU) and train each
      layer from its own estimate with a one-layer backward, masking the estimate by ReLU′. On the
      plain MLP the difference is only where the tangent sits (the hidden layer's output, so the
      directional derivative also picks up tangent components on inactive units);
    * no LayerNorm inside the layers (theirs normalise each layer's pre-activation, which the paper
      finds essential for FG-A at scale); the ResMLP's pre-LN blocks keep theirs;
    * one tangent per sample per position, one jvp for all positions, as theirs (num_passes = 1);
    * the readout: exact CE gradient of readout(h_L.detach()), as theirs; per-block clip at
      settings.clip; the optimiser is their supervised config's SGD (below), without its 10-epoch
      warm-up.
  lg-fg-a (Ren et al. 2023, LG-FG-A):
    * the local loss: one linear classifier per block output on the flattened state (through a
      parameter-free LayerNorm on the ResMLP), the readout at h_L. Ren et al.'s local losses are
      linear classifiers too, but on spatially pooled groups of channels (their "patch-wise and
      group-wise" losses, spatial_avg_group_linear); a plain MLP state has no patches, and one group
      is the whole state — so on an MLP this is their loss with one group, as far as we can tell;
    * their local losses sit after each block's last layer with stop-gradients between blocks; here
      the tangent at h_{l+1} = block l's output measures the local loss there, and the block learns by
      backprop of the estimate inside itself (as fg-a);
    * everything else as fg-a.

Numbers known so far (unverified here unless stated): Ren et al. Table 3, MNIST test error: BP 2.41,
FG-W 8.56, FG-A 3.76, LG-FG-A 2.55 — not read here; the abstract (read) says their approach "matches
backprop on MNIST" with their LocalMixer architecture, so that table is probably on a LocalMixer, not
an MLP; its network and recipe are not in the released configs (ImageNet only), hence no
`paper_setting` for fg-a and lg-fg-a. fg-w's is Baydin et al.'s MLP as orobix/fwdgrad configures it. orobix/fwdgrad (an
unofficial Baydin et al. implementation): 784-1024-1024-10 ReLU, SGD lr 2e-4 with lr_i = lr·e^(−1e-4·i),
batch 64, 200 epochs (configs/model/default.yaml, configs/optimization/default.yaml,
configs/dataset/default.yaml) — read here.
"""
from __future__ import annotations

import torch
from torch.func import functional_call, jvp

from ..errors import CreditAuditError
from ..seeding import draw_on_host
from .base import refuse_unless_vector_stream
from .local import LocalMethod, input_credit
from .local_losses import LocalLosses
from .recipe import Recipe
from .setting import PaperSetting

REN = "Ren, Kornblith, Liao & Hinton 2023 (ICLR), 'Scaling forward gradient with local losses'"
REN_CODE = "google-research/google-research local_forward_gradient (train_mixer_supervised.py)"
BAYDIN = "Baydin, Pearlmutter, Syme, Wood & Torr 2022, 'Gradients without backpropagation'"

# Ren et al.'s released supervised config (configs/supervised.py, for ImageNet): SGD momentum 0.9,
# lr 0.05, weight decay 1e-4, warm-up + cosine over 120 epochs, batch 256
REN_RECIPE = Recipe(
    optimizer="sgd", lr=0.05, momentum=0.9, weight_decay=1e-4, schedule="cosine", batch_size=256,
    citation=f"{REN}; {REN_CODE.split(' (')[0]} configs/supervised.py (mom 0.9, lr 0.05, wd 1e-4, "
             "warmup_cosine, batch 256; the ImageNet config — the MNIST recipe of their Table 3 is not "
             "in the released code; the 10-epoch warm-up is not reproduced)")


def check_arch(model, rule: str) -> None:
    """One line refusing an architecture the forward-gradient rules are not written for."""
    refuse_unless_vector_stream(model, rule, "its jvp pass is not written for BatchNorm statistics or "
                                "token streams", "the jvp pass recomputes the forward")


# The forward-gradient steps train eagerly (`compilable` False): torch.compile (torch 2.13, fullgraph,
# even with the eager backend) cannot trace `torch.func.jvp` through the model — through LayerNorm its
# fake-tensor pass hits an internal assert at `_fw_primal`, and the grad mode around the jvp is lost
# (the readout's backward then finds no graph). `Method.step_function` then returns the eager step.
JVP_COMPILES = False


class _ActivityTangents(LocalMethod):
    """What fg-a and lg-fg-a share: a tangent u_{l,i} ~ N(0, I) per sample at each perturbed position,
    drawn in `prepare_step` from `self.gen` (module docstring)."""

    def compilable(self) -> bool:
        return JVP_COMPILES

    def _setup_tangents(self, model) -> None:
        # the perturbed positions: h_0 … h_L, or h_1 … h_L on the plain MLP (h_0 = x: nothing to train)
        self.positions_perturbed = tuple(range(0 if model.residual else 1, model.n_blocks + 1))
        self.credit_seed = int(torch.randint(2 ** 62, (1,), generator=self.gen))
        self._tangents: dict[int, torch.Tensor] | None = None

    def _draw(self, n: int, gen: torch.Generator, like: torch.Tensor) -> dict[int, torch.Tensor]:
        """u_l ~ N(0, I), (n, *position_shape(l)) per perturbed position l, from the CPU generator."""
        return {l: draw_on_host(torch.randn, (n,) + tuple(self.model.position_shape(l)), gen, like)
                for l in self.positions_perturbed}

    def prepare_step(self):
        self._tangents = self._draw(self.settings.batch_size, self.gen, self.model.head_parameters()[0])

    def _step_tangents(self, n: int) -> dict[int, torch.Tensor]:
        if not self._tangents:            # nothing perturbed: the plain MLP without hidden layers
            return {}
        if n > next(iter(self._tangents.values())).shape[0]:
            raise CreditAuditError(f"{self.name} drew tangents for batches of "
                                   f"{next(iter(self._tangents.values())).shape[0]}; got {n} samples "
                                   "(set the method's batch_size)")
        return {l: u[:n] for l, u in self._tangents.items()}

    def _estimate(self, hidden: list[torch.Tensor], y: torch.Tensor,
                  tangents: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        """[a_0 … a_L] from the clean states (detached) and the tangents; an unperturbed position
        (the plain MLP's input) gets 0 here."""
        raise NotImplementedError

    def gradients(self, x, y):
        fwd = self.local_forward(x)
        credit = self._estimate(fwd.hidden, y, self._step_tangents(x.shape[0]))
        return self.local_gradients(y, fwd, credit)

    def _credit_with(self, x, y, gen: torch.Generator) -> list[torch.Tensor]:
        with torch.no_grad():
            logits, hidden = self.model(x, return_hidden=True)
        credit = [a.detach() for a in self._estimate(hidden, y, self._draw(len(y), gen, logits))]
        if 0 not in self.positions_perturbed and self.model.n_blocks:   # a_0 = ∂f_0(x)ᵀ a_1
            credit[0] = input_credit(self.model, x, credit[1])
        return credit

    def credit(self, x, y):
        return self._credit_with(x, y, torch.Generator().manual_seed(self.credit_seed))

    def fresh_feedback_credit(self, x, y, gen):
        """The same estimator under tangents drawn afresh from `gen`: Γ's null is the one-draw
        chance level (module docstring)."""
        return self._credit_with(x, y, gen)

    def extra_state(self):
        return {"credit_seed": self.credit_seed}

    def load_extra_state(self, state):
        self.credit_seed = int(state["credit_seed"])


class ForwardGradientA(_ActivityTangents):
    """fg-a: a_l = (Σ_k ⟨∂ℓ_i/∂h_k, u_k⟩)·u_l from one jvp with a tangent at every h_l; local losses."""

    name = "fg-a"
    summary = ("forward gradient, activity perturbation (Ren et al. 2023, FG-A): a_l = (∇ℓ·u) u_l from "
               "one jvp with tangents u on every h_l; block l learns from a_{l+1} by its local backward")
    random_feedback = True
    null_note = ("the null redraws the tangents: Γ − null ≈ 0 is what an unbiased one-draw forward "
                 "gradient scores; its level is ≈ √(2/π)·‖g_l‖/(√D·√Σ_k‖g_k‖²) (one directional "
                 "derivative shared by every position's tangent, as node perturbation's), far below 1 "
                 "though the estimate is unbiased")
    recipe = REN_RECIPE

    def __init__(self, model, settings):
        check_arch(model, self.name)
        super().__init__(model, settings)
        self._setup_tangents(model)
        self.opt = self.add_optimizer(self.local_param_groups())      # embed, trainable blocks, head

    def _estimate(self, hidden, y, tangents):
        model, n_blocks = self.model, self.model.n_blocks
        if not tangents:                  # the plain MLP without hidden layers: nothing perturbed
            return [torch.zeros_like(h) for h in hidden]

        def per_sample_loss(z: tuple[torch.Tensor, ...]) -> torch.Tensor:
            # h̃_0 = h_0 + z_0,  h̃_{l+1} = advance(h̃_l, f_l(h̃_l)) + z_{l+1},  ℓ_i(readout(h̃_L))
            zs = dict(zip(tangents, z))
            h = hidden[0] + zs[0] if 0 in zs else hidden[0]
            for l in range(n_blocks):
                h = model.advance(h, model.blocks[l](h)) + zs[l + 1]
            return model.loss(model.readout(h), y, reduction="none")

        with torch.no_grad():      # forward-mode AD only: no autograd graph through the stack
            zeros = tuple(torch.zeros_like(u) for u in tangents.values())
            _, d = jvp(per_sample_loss, (zeros,), (tuple(tangents.values()),))   # d_i = Σ_k ⟨g_k,i, u_k,i⟩
        d = d.view((-1,) + (1,) * (hidden[0].dim() - 1))
        return [d * tangents[l] if l in tangents else torch.zeros_like(hidden[l])     # a_l = d · u_l
                for l in range(n_blocks + 1)]


class LocalGreedyForwardGradientA(_ActivityTangents, LocalLosses):
    """lg-fg-a: a_l = ⟨∂ℓ_aux,l/∂h_l, u_l⟩·u_l, each local classifier's own directional derivative."""

    name = "lg-fg-a"
    summary = ("forward gradient of local losses (Ren et al. 2023, LG-FG-A): a_l = (∇ℓ_aux,l·u_l) u_l, "
               "ℓ_aux,l a linear classifier on h_l (the readout at h_L); local backward per block")
    random_feedback = True
    null_note = ("the null redraws the tangents: Γ − null ≈ 0 is what a one-draw forward gradient "
                 "scores; each position's estimate is unbiased for its local classifier's gradient "
                 "(cosine ≈ √(2/π)/√D with it), not for the end-to-end one")
    recipe = REN_RECIPE
    option_defaults = {"sim": 0.0}
    option_ranges = {"sim": (0.0, 0.0)}
    option_help = {"sim": "fixed at 0 (plain local CE, as Ren et al.'s local classifiers); declared "
                          "because the local classifiers are local-loss's"}

    def __init__(self, model, settings):
        check_arch(model, self.name)
        LocalLosses.__init__(self, model, settings)      # aux heads from self.gen, optimisers
        self._setup_tangents(model)

    def _estimate(self, hidden, y, tangents, with_aux: bool = False):
        n_blocks = self.model.n_blocks
        index = {l: i for i, l in enumerate(self.positions)}     # local classifier of position l

        def local_loss(l: int, h: torch.Tensor) -> torch.Tensor:
            """ℓ_aux,l per sample at h (N, …); the model's own loss at h_L."""
            if l == n_blocks:
                return self.model.loss(self.model.readout(h), y, reduction="none")
            z = h.flatten(1)
            if not self.plain:
                z = torch.nn.functional.layer_norm(z, z.shape[-1:])          # z_l = LN(h_l)
            return torch.nn.functional.cross_entropy(self.aux[index[l]](z), y, reduction="none")

        def local_losses(z: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
            return tuple(local_loss(l, hidden[l] + zl) for l, zl in zip(tangents, z))

        if not tangents:                  # the plain MLP without hidden layers: nothing perturbed
            return [torch.zeros_like(h) for h in hidden]
        if with_aux:   # the classifiers train on their exact gradients, at the detached states
            with torch.enable_grad():
                aux_total = sum(local_loss(l, hidden[l].detach()).mean() for l in self.positions)
                params = list(self.aux.parameters())
                if params:
                    for p, g in zip(params, torch.autograd.grad(aux_total, params)):
                        p.grad = g
        with torch.no_grad():
            zeros = tuple(torch.zeros_like(u) for u in tangents.values())
            _, ds = jvp(local_losses, (zeros,), (tuple(tangents.values()),))   # d_l,i = ⟨∂ℓ_aux,l,i/∂h_l, u_l,i⟩
        shape = (-1,) + (1,) * (hidden[0].dim() - 1)
        est = {l: d.view(shape) * tangents[l] for l, d in zip(tangents, ds)}   # a_l = d_l · u_l
        return [est[l] if l in est else torch.zeros_like(hidden[l]) for l in range(n_blocks + 1)]

    def gradients(self, x, y):
        fwd = self.local_forward(x)
        credit = self._estimate(fwd.hidden, y, self._step_tangents(x.shape[0]), with_aux=True)
        return self.local_gradients(y, fwd, credit)

    def exact_positions(self, n_blocks):
        """None: a_L is a one-draw estimate of the readout's gradient (local-loss's a_L is exact)."""
        return frozenset()

    def extra_state(self):
        return {"credit_seed": self.credit_seed, "aux": dict(self.aux.state_dict())}

    def load_extra_state(self, state):
        self.credit_seed = int(state["credit_seed"])
        self.aux.load_state_dict(state["aux"])


class ForwardGradientW(LocalMethod):
    """fg-w: g_θ = (∂J/∂θ·v)·v, one jvp of the loss with a tangent v over the trainable weights."""
    reads_clip = False                  # its step clips nothing (settings.clip)

    name = "fg-w"
    summary = ("forward gradient, weight perturbation (Baydin et al. 2022): g_θ = (∇J·v) v from one jvp "
               "with a tangent v ~ N(0, I) over the embedding and trainable blocks' weights")
    random_feedback = True
    null_note = ("the null redraws the weight tangent: Γ − null ≈ 0 is what one unbiased draw scores; "
                 "a_l is the push-forward d_i·(∂h_l/∂θ·v) of the step's estimate, whose expectation is "
                 "the tangent kernel applied to g_l, so even its mean is not g_l")
    # Baydin et al.'s MNIST MLP recipe as orobix/fwdgrad configures it: plain SGD, lr 2e-4, batch 64
    recipe = Recipe(
        optimizer="sgd", lr=2e-4, momentum=0.0, weight_decay=0.0, schedule="constant", batch_size=64,
        citation=f"{BAYDIN}, MNIST MLP; orobix/fwdgrad configs/optimization/default.yaml (lr 2e-4, "
                 "k 1e-4) and configs/dataset/default.yaml (batch 64), plain SGD (mnist_fwdgrad.py); "
                 "their per-iteration decay lr·e^(−k·i) is replaced by a constant lr")
    # `creditaudit reproduce fg-w`: Baydin et al.'s MNIST MLP, as orobix/fwdgrad configures it
    paper_setting = PaperSetting(
        citation=BAYDIN,
        code="orobix/fwdgrad (an unofficial implementation): configs/model/default.yaml (784-1024-1024-10 "
             "ReLU), configs/optimization/default.yaml, configs/dataset/default.yaml, mnist_fwdgrad.py",
        dataset="mnist",
        width=1024,
        blocks=2,
        activation="relu",
        loss="ce",
        epochs=200,
        recipe=recipe,
        reported=None,
        bp=None,
        deviations=("no test error of Baydin et al.'s MLP was read here (their MNIST figures plot the "
                    "training loss against time and iterations): no paper number is compared",
                    "the learning rate is constant; theirs decays per iteration, lr·e^(−1e-4·i)",
                    "the readout trains on its exact gradient; Baydin et al. perturb every parameter",
                    "inputs are standardised with MNIST's mean and std"))

    def __init__(self, model, settings):
        check_arch(model, self.name)
        super().__init__(model, settings)
        self.opt = self.add_optimizer(self.local_param_groups())      # embed, trainable blocks, head
        ids = {id(p): name for name, p in model.named_parameters()}
        perturbed = self.embed_params() + self.trainable_block_params()
        self.theta = {ids[id(p)]: p for p in perturbed}              # θ: the weights with a tangent
        self.credit_seed = int(torch.randint(2 ** 62, (1,), generator=self.gen))
        self._tangent: dict[str, torch.Tensor] | None = None

    def compilable(self) -> bool:
        return JVP_COMPILES

    def _draw(self, gen: torch.Generator, like: torch.Tensor) -> dict[str, torch.Tensor]:
        """v ~ N(0, I) over θ: one flat draw from the CPU generator, split by parameter."""
        sizes = [p.numel() for p in self.theta.values()]
        flat = draw_on_host(torch.randn, (sum(sizes),), gen, like)
        return {name: chunk.view_as(p) for (name, p), chunk in zip(self.theta.items(), flat.split(sizes))}

    def prepare_step(self):
        self._tangent = self._draw(self.gen, self.model.head_parameters()[0])

    def _directional(self, x, y, tangent):
        """(ℓ_i, d_i = ∂ℓ_i/∂θ·v, [t_l = ∂h_l/∂θ·v]) from one jvp of the model at its own weights."""
        names = tuple(self.theta)

        def forward(*theta):
            logits, hidden = functional_call(self.model, dict(zip(names, theta)), (x,),
                                             {"return_hidden": True})
            return self.model.loss(logits, y, reduction="none"), tuple(hidden)

        with torch.no_grad():
            primals = tuple(p.detach() for p in self.theta.values())
            (loss, _), (d, t) = jvp(forward, primals, tuple(tangent[k] for k in names))
        return loss, d, list(t)

    def gradients(self, x, y):
        if not self.theta:                # nothing below the readout trains (the shallow mlp)
            fwd = self.local_forward(x)
            return self.local_gradients(y, fwd, [torch.zeros_like(h) for h in fwd.hidden])
        _, d, _ = self._directional(x, y, self._tangent)
        d_mean = d.mean()                                                   # d = ∇J·v, J = mean_i ℓ_i
        for name, p in self.theta.items():
            p.grad = d_mean * self._tangent[name]                           # g_θ = d · v
        # the readout: exact CE gradient at h_L.detach()
        with torch.no_grad():
            h = self.model(x, return_hidden=True)[1][-1]
        ce = self.model.loss(self.model.readout(h), y)
        ce.backward()              # no clip: the published lr is sized for the raw d·v (module docstring)
        return ce.detach()

    def _credit_with(self, x, y, gen):
        with torch.no_grad():
            logits, hidden = self.model(x, return_hidden=True)
        if not self.theta:
            return [torch.zeros_like(h) for h in hidden]
        _, d, t = self._directional(x, y, self._draw(gen, logits))
        d = d.view((-1,) + (1,) * (hidden[0].dim() - 1))
        return [(d * tl).detach() for tl in t]                            # a_l = d_i · t_l,i

    def credit(self, x, y):
        return self._credit_with(x, y, torch.Generator().manual_seed(self.credit_seed))

    def fresh_feedback_credit(self, x, y, gen):
        """The same push-forward under a weight tangent drawn afresh from `gen` (Γ's null)."""
        return self._credit_with(x, y, gen)

    def extra_state(self):
        return {"credit_seed": self.credit_seed}

    def load_extra_state(self, state):
        self.credit_seed = int(state["credit_seed"])
