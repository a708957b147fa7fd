"""dfa — direct feedback alignment (Nøkland 2016), as in the paper's script; dfa-penalty adds λ‖f‖².

    e       = ∂ℓ/∂logits per sample: softmax(logits) − onehot(y) (σ − onehot under the mlp's BCE)
    B_l     ~ N(0, 1/C), shape (d, C), l = 0 … max(L, 1) − 1     fixed, drawn once per seed
    a_{l+1} = rms_normalise(e · B_lᵀ)                            credit at block l's output
    (option normalise = 0: a = e · Bᵀ, Nøkland 2016's un-normalised signal)

rms_normalise divides each sample's projected error by its own rms over the features (+1e-6), as
the paper's script does: the credit keeps per-feature rms 1 however small the error gets, so the
blocks' updates do not shrink as the loss falls (measured: ‖h_L‖ grew 33× in 5 epochs with it,
9× without). Nøkland's DFA (normalise = 0) feeds e · Bᵀ itself, whose size falls with ‖e‖.

    block l (trainable):  (f_l(h_l.detach()) · a_{l+1}).sum(-1).mean()  [+ λ · mean_i ‖f_l(h_l)_i‖²]
    embed:                (embed(x) · a_0).sum(-1).mean()
    readout:              ℓ(readout(h_L.detach()), y)   (the true gradient: out_ln, out_head)

Position 0 (`position_credit`):
  * residual models (ResMLP, vit-mini, resnet-small): a_0 = rms_normalise(e · B_0ᵀ), the embedding
    reuses B_0 as the paper's script does (dfa_epoch: block l uses Bs[l], embed Bs[0]), so a_0 = a_1
    whenever L ≥ 1. With no blocks (shallow) one matrix B_0 is still drawn, for the embedding.
  * the plain MLP (arch mlp, no residual stream): h_0 is the input x itself, which has no parameters
    and needs no credit (Nøkland's rule has none there). `credit` reports a_0 = ∂/∂x ⟨f_0(x), a_1⟩ =
    W_0ᵀ (a_1 ⊙ f_0'(z_0)), the credit pulled back through hidden layer 0 — what the rule's
    layer-0 signal asks of the input, of the input's shape (N, D_in); the training step uses none
    (zeros). The protocol's deep Γ averages positions 1 … L and never reads it.

On the plain MLP block l is one layer h_{l+1} = act(W_l h_l + b_l), so the local loss's gradient is
Nøkland's rule exactly: ∂/∂W_l = mean_i ((a_{l+1} ⊙ f'(z_l)) ⊗ h_l)_i with z_l = W_l h_l + b_l
(tested by hand in tests/test_plain_mlp_local.py), and the readout out_head trains on e, as his
output layer does.

The script's per-block loop (one optimizer, one backward and one clip per block) is fused here into
one backward of the summed losses, one optimizer with a parameter group per part, a per-block clip
at settings.clip and one step: the parameter sets are disjoint, so the result is the same (tested).

The feedback matrices come from a generator derived from (seed, "method:dfa") for both variants, so
dfa and dfa-penalty of one seed share their B (λ = 0 reproduces dfa exactly).
Where it differs from the original (Nøkland 2016, "Direct feedback alignment provides learning in
deep neural networks": hidden layer l of a plain MLP gets δ_l = (B_l e) ⊙ f'(z_l), ΔW_l = −δ_l h_{l−1}ᵀ,
the output layer trains on e):
  * the projected error is rms-normalised per sample by default (the audited paper's script;
    option normalise = 0 gives Nøkland's e·Bᵀ, tested equal to it).
  * on the residual models it is delivered at the output of each residual block (the stream
    h_{l+1}), and the block's parameters (W2, W1 and its LayerNorm) learn by backpropagating that
    signal through the block ((f_l(h_l) · a_{l+1}).sum(-1).mean()), not by a per-layer δ_l ⊙ f';
    the embedding reuses B_0. On the plain MLP it is his per-layer rule (above).
  * B_l ~ N(0, 1/C), the audited paper's script's draw (not Nøkland's); per-block gradient clip at
    settings.clip (not Nøkland's); the optimiser is the run's recipe (`Method.recipe`: the
    audited paper's shared AdamW with a cosine schedule for dfa and dfa-penalty, which publish no
    recipe of their own here).
  * dfa-penalty's λ‖f_l‖² is the audited paper's addition, not Nøkland's.
"""
from __future__ import annotations

import math

import torch

from ..model.resmlp import ResidualMLP
from ..model.resnet import SmallResNet
from ..model.vit import ViTMini
from ..seeding import derived_generator
from .recipe import Recipe
from .setting import PaperSetting, Reported
from .local import LocalMethod, output_error, rms_normalise


def draw_feedback(model, gen: torch.Generator) -> list[torch.Tensor]:
    """B_l ~ N(0, 1/C), shape (D, C) with D the per-sample size of the stream (d for the ResMLP,
    T·d for a token stream, C·H·W for a feature map), one per block (at least one, for the embedding)."""
    d, c = math.prod(model.stream_shape), model.n_classes
    like = model.head_parameters()[0]
    return [(torch.randn(d, c, generator=gen, dtype=torch.float64) / math.sqrt(c))
            .to(device=like.device, dtype=like.dtype) for _ in range(max(model.n_blocks, 1))]


def dfa_credit(e: torch.Tensor, feedback: list[torch.Tensor], n_blocks: int,
               shape: tuple[int, ...], normalise: bool = True) -> list[torch.Tensor]:
    """[a_0, …, a_L] with a_0 = rms(e·B_0ᵀ) and a_{l+1} = rms(e·B_lᵀ) (normalise=False: e·Bᵀ
    itself), each of the stream's shape. Lone: e (N, C), B_l (D, C). On the member axis:
    e (K, N, C), B_l (K, D, C), member k's e projected through member k's B."""
    lead = e.shape[:-1]
    projected = [(e @ b.transpose(-1, -2)).view(lead + shape) for b in feedback]     # a = e · Bᵀ
    if normalise:
        projected = [rms_normalise(a, batch_dims=len(lead)) for a in projected]   # a / rms(a)
    return [projected[0]] + projected[:n_blocks]


def position_credit(model, credit: list[torch.Tensor], x: torch.Tensor | None = None) -> list[torch.Tensor]:
    """`dfa_credit`'s list fitted to the model's positions. A residual model: as it is. The plain MLP
    (h_0 = x, no parameters at position 0): a_0 replaced by the credit pulled back through hidden
    layer 0, a_0 = ∂/∂x ⟨f_0(x), a_1⟩ = W_0ᵀ (a_1 ⊙ f_0'(z_0)), shape (N, D_in), when the input x is
    given (`credit`, for the protocol), else zeros of that shape (the training step, which trains
    nothing with it)."""
    if model.residual:
        return credit
    if len(credit) == 1:           # no hidden layer (the shallow control): nothing takes credit
        return [credit[0].new_zeros((credit[0].shape[0],) + tuple(model.position_shape(0)))]
    if x is None:
        return [credit[1].new_zeros((credit[1].shape[0],) + tuple(model.position_shape(0)))] + credit[1:]
    with torch.enable_grad():
        h0 = model.embed_input(x).detach().requires_grad_(True)
        pulled, = torch.autograd.grad(model.blocks[0](h0), h0, credit[1].detach())   # W_0ᵀ(a_1 ⊙ f')
    return [pulled.detach()] + credit[1:]


NORMALISE_HELP = ("1 = each sample's projected error divided by its rms (the paper's script); "
                  "0 = e·Bᵀ itself (Nøkland 2016)")


class DFA(LocalMethod):
    name = "dfa"
    paper = True
    random_feedback = True
    member_archs = (ResidualMLP, ViTMini, SmallResNet)
    option_defaults = {"normalise": 1}
    option_ranges = {"normalise": (0, 1)}
    option_help = {"normalise": NORMALISE_HELP}

    # the paper's own setting, for `creditaudit reproduce` (methods/setting.py)
    paper_setting = PaperSetting(
        citation="Nøkland 2016 (NeurIPS)",
        code="anokland/dfa-torch (commit 17dae73): Main.lua:22-43, Models/mlp.lua:24-103, "
             "Models/ErrorFeedback.lua:40-43",
        dataset="mnist-01",                # pixels in [0, 1], as the reference reads them
        width=800,
        blocks=2,
        activation="tanh",
        loss="bce",
        dropout=0.5,
        options={"normalise": 0},
        epochs=300,
        recipe=Recipe(optimizer="rmsprop", lr=1e-4, weight_decay=0.0, schedule="constant", batch_size=64,
                      citation="anokland/dfa-torch Main.lua:22-43 (RMSprop, lr 1e-4, batch 64, 300 epochs)"),
        reported=Reported(1.45, "the paper's abstract: \"combined with dropout, the method achieves "
                                "1.45% error on the permutation invariant MNIST task\"",
                          selection="not stated in the abstract"),
        bp=None,
        deviations=("the abstract does not name the network; 2×800 tanh is the reference code's "
                    "default (Main.lua: num_layers 2, num_hidden 800) and its dropout flag's",
                    "dropout 0.5 on each hidden layer only; the reference's dropout flag also drops "
                    "10 % of the input pixels (mlp.lua:40-51)",
                    "the forward weights start from torch's default draw; the reference starts DFA "
                    "from all-zero weights (mlp.lua:83-98), which would make the frozen control a "
                    "constant network",
                    "the paper's Table 1 (its bp column and spreads) could not be read here: no bp "
                    "number is compared"))

    def __init__(self, model, settings):
        super().__init__(model, settings)
        self.gen = derived_generator(settings.seed, "method:dfa")
        self.feedback = draw_feedback(model, self.gen)
        self.opt = self.add_optimizer(self.local_param_groups())
        options = self.resolve_options(settings.options)
        # the residual penalty λ: 0 for dfa, the `lam` option for dfa-penalty, and the rms
        # normalisation (Python values, read once: the step branches on them, never on a tensor)
        self.lam = float(options.get("lam", 0.0))
        self.normalise = bool(options.get("normalise", 1))   # a subclass may declare knobs of its own only

    def _credit(self, x, y, feedback):
        """(h_0 … h_L, [a_0 … a_L]) on (x, y) under `feedback` (a subclass may override it: its
        credit and Γ's null then go through its own)."""
        with torch.no_grad():
            logits, hidden = self.model(x, return_hidden=True)
            e = self.model.output_error(logits, y)                         # e = ∂ℓ/∂logits
        return hidden, self._credit_of_error(x, e, feedback)

    def _output_error(self, x, y):
        """e = ∂ℓ/∂logits of the model on (x, y): all the feedback B_l is applied to."""
        with torch.no_grad():
            return self.model.output_error(self.model(x), y)

    def _credit_of_error(self, x, e, feedback):
        credit = dfa_credit(e, feedback, self.model.n_blocks, self.model.stream_shape, self.normalise)
        return position_credit(self.model, credit, x)

    def gradients(self, x, y):
        fwd = self.local_forward(x)
        e = self.model.output_error(fwd.logits.detach(), y)                    # e = ∂ℓ/∂logits
        credit = dfa_credit(e, self.feedback, self.model.n_blocks, self.model.stream_shape, self.normalise)
        credit = position_credit(self.model, credit)                            # the mlp: a_0 unused
        return self.local_gradients(y, fwd, credit, lam=self.lam)

    def member_feedback(self):
        return {f"B{l}": b for l, b in enumerate(self.feedback)}

    def member_gradients(self, stack, x, y):
        """The same step per member: e_k, a_k from member k's own B_l; blocks that member k does
        not train weigh 0 in its objective; clipping per member and block."""
        fwd = self.member_local_forward(stack.net, x, stack.trained)
        e = output_error(fwd.logits.detach(), y)                               # (K, B, C)
        feedback = [stack.feedback[f"B{l}"] for l in range(len(self.feedback))]
        credit = dfa_credit(e, feedback, stack.net.n_blocks, self.model.stream_shape, self.normalise)
        return self.member_local_gradients(stack.net, y, fwd, credit, stack.trains, lam=self.lam)

    def credit(self, x, y):
        return self._credit(x, y, self.feedback)[1]

    def fresh_feedback_credit(self, x, y, gen):
        return self._credit(x, y, draw_feedback(self.model, gen))[1]

    def fresh_feedback_credits(self, batches, gen):
        """One draw of every B_l for every batch, drawn once (a subclass with its own
        `fresh_feedback_credit` gets it, batch by batch)."""
        if not self._reproduces(DFA, "fresh_feedback_credit"):
            return super().fresh_feedback_credits(batches, gen)
        feedback = draw_feedback(self.model, gen)
        return [self._credit(x, y, feedback)[1] for x, y in batches]

    def fresh_feedback_draws(self, batches, gens):
        """The forward pass and its output error e do not depend on B: each batch's is computed
        once for every draw (20 forwards of each eval batch saved per null), then each draw is
        only e·B_l per position. Only for dfa's own credit and null, on a model in eval mode (in
        train mode a dropout layer would draw anew at every forward); else draw after draw."""
        if self.model.training or not self._reproduces(DFA, "_credit", "_output_error", "fresh_feedback_credit",
                                                        "fresh_feedback_credits"):
            yield from super().fresh_feedback_draws(batches, gens)
            return
        errors = [(x, self._output_error(x, y)) for x, y in batches]
        for gen in gens:
            feedback = draw_feedback(self.model, gen)
            yield [self._credit_of_error(x, e, feedback) for x, e in errors]

    def extra_state(self):
        return {"feedback": {f"B{l}": b for l, b in enumerate(self.feedback)}}

    def load_extra_state(self, state):
        saved = state.get("feedback", {})
        for l, b in enumerate(self.feedback):
            b.copy_(saved[f"B{l}"])


class DFAPenalty(DFA):
    """dfa plus λ · mean_i ‖f_l(h_l)_i‖² in every trainable block's local loss (option `lam`)."""

    name = "dfa-penalty"
    paper = True
    option_defaults = {"lam": 1e-2, "normalise": 1}
    option_ranges = {"lam": (0.0, math.inf), "normalise": (0, 1)}
    option_help = {"lam": "residual penalty λ in each block's local loss (λ = 0 is plain dfa)",
                   "normalise": NORMALISE_HELP}
    sweep = {"lam": (0.0, 1e-4, 1e-3, 1e-2, 1e-1)}
    trainable_only_options = {"lam": 0.0}      # λ‖f_l‖² enters only trainable blocks' local loss
