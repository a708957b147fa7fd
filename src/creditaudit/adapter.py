"""How the protocol reaches the residual stream of a model that is not a creditaudit class.

The protocol measures a model only through its residual stream (model/stream.py):

    h_0     = embed(x)
    h_{l+1} = h_l + f_l(h_l)          f_l = blocks[l], the residual branch (skip=True)
            = blocks[l](h_l)          (skip=False: the block module adds its own skip)
    logits  = readout(h_L)            e.g. the terminal LayerNorm, then the head

An `Adapter` names those parts on the user's model by attribute path (dotted, so a
LightningModule wrapping a network says "net.blocks"):

    Adapter(embed="embed", blocks="layers", readout=("norm", "head"))

`embed` and `readout` may also be callables (module, tensor) ↦ tensor, for models whose forward
does more than call one module (e.g. flattens the input first). A model that can build its own
stream is reached by `Adapter(stream=lambda m: ResidualStream(...), blocks="layers")`; `blocks`
is always needed, because the frozen-blocks control freezes exactly those parameters.
A model with a `.stream()` method (every creditaudit architecture) needs no adapter.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence, Union

import torch
import torch.nn as nn

from .errors import CreditAuditError
from .model import ResidualStream

Part = Union[str, Sequence[str], Callable[[nn.Module, torch.Tensor], torch.Tensor]]


@dataclass(frozen=True)
class Adapter:
    """Which modules of a model are the embedding, the residual blocks and the readout.

    blocks:  attribute path of a ModuleList/Sequential of the blocks, or a list of paths, one per block.
    embed:   x ↦ h_0: an attribute path, a list of paths applied in order, or fn(model, x).
    readout: h_L ↦ logits: an attribute path, a list of paths applied in order, or fn(model, h).
    skip:    True when each block module is the branch f_l alone and the adapter adds h + f_l(h);
             False when the block module returns h_{l+1} itself.
    stream:  instead of embed/readout, fn(model) ↦ ResidualStream.
    """

    blocks: str | Sequence[str]
    embed: Part | None = None
    readout: Part | None = None
    skip: bool = True
    stream: Callable[[nn.Module], ResidualStream] | None = None

    def __post_init__(self):
        """Each part checked for its kind now, so a wrong one is one line at construction rather
        than an AttributeError when the Monitor first reaches the model."""
        paths = lambda p: isinstance(p, str) and bool(p) or (
            isinstance(p, (list, tuple)) and bool(p) and all(isinstance(q, str) and q for q in p))
        if not paths(self.blocks):
            raise CreditAuditError(f"Adapter(blocks=...) must name the residual blocks: an attribute "
                                   f"path such as \"layers\", or a list of paths, one per block; got "
                                   f"{self.blocks!r}")
        for what, part in (("embed", self.embed), ("readout", self.readout)):
            if part is not None and not (paths(part) or callable(part)):
                raise CreditAuditError(f"Adapter({what}=...) must be an attribute path, a list of "
                                       f"paths or a function (model, tensor) -> tensor; got {part!r}")
        if not isinstance(self.skip, bool):
            raise CreditAuditError(f"Adapter(skip=...) must be True or False, got {self.skip!r}")
        if self.stream is not None and not callable(self.stream):
            raise CreditAuditError(f"Adapter(stream=...) must be a function model -> ResidualStream, "
                                   f"got {self.stream!r}")

    def describe(self) -> dict:
        """A JSON record of the adapter (callables by their qualified name)."""
        name = lambda p: (p if isinstance(p, str) or p is None else
                          list(p) if isinstance(p, (list, tuple)) else
                          f"{getattr(p, '__module__', '?')}:{getattr(p, '__qualname__', repr(p))}")
        return {"blocks": name(self.blocks), "embed": name(self.embed), "readout": name(self.readout),
                "skip": self.skip, "stream": name(self.stream)}


def _module(model: nn.Module, path: str) -> nn.Module:
    """model.<path> for a dotted attribute path; a missing one is one clear line naming it."""
    obj = model
    for i, part in enumerate(path.split(".")):
        if not hasattr(obj, part):
            have = ", ".join(name for name, _ in obj.named_children()) if isinstance(obj, nn.Module) else ""
            where = ".".join(path.split(".")[:i]) or type(model).__name__
            raise CreditAuditError(f"the adapter names {path!r}, but {where} has no attribute {part!r}"
                                   f"{' (its submodules: ' + have + ')' if have else ''}; fix the "
                                   "Adapter's attribute paths")
        obj = getattr(obj, part)
    if not callable(obj):
        raise CreditAuditError(f"the adapter names {path!r}, which is a {type(obj).__name__}, not a "
                               "module; name the module that computes that part")
    return obj


def _part(model: nn.Module, spec: Part, what: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if spec is None:
        raise CreditAuditError(f"the adapter gives no {what}: set Adapter({what}=...) or Adapter(stream=...)")
    if isinstance(spec, str):
        return _module(model, spec)
    if isinstance(spec, (list, tuple)):
        mods = [_module(model, p) for p in spec]

        def chain(t: torch.Tensor) -> torch.Tensor:
            for m in mods:
                t = m(t)
            return t
        return chain
    if callable(spec):
        return lambda t: spec(model, t)
    raise CreditAuditError(f"Adapter {what} must be an attribute path, a list of paths or a "
                           f"function (model, tensor) -> tensor; got {type(spec).__name__}")


def block_modules(model: nn.Module, adapter: Adapter | None) -> list[nn.Module]:
    """The residual block modules of `model`, whose parameters the frozen control freezes."""
    if adapter is None:
        blocks = getattr(model, "blocks", None)
        if not isinstance(blocks, (nn.ModuleList, nn.Sequential)):
            raise CreditAuditError(f"cannot tell which modules of {type(model).__name__} are its "
                                   "residual blocks; pass adapter=creditaudit.Adapter(blocks=...)")
        return list(blocks)
    if isinstance(adapter.blocks, str):
        found = _module(model, adapter.blocks)
        if not isinstance(found, (nn.ModuleList, nn.Sequential)):
            raise CreditAuditError(f"the adapter's blocks={adapter.blocks!r} is a "
                                   f"{type(found).__name__}, not a ModuleList/Sequential of blocks; "
                                   "name the container, or list one path per block")
        return list(found)
    return [_module(model, p) for p in adapter.blocks]


class _Step:
    """h ↦ h + f(h) (skip added) or h ↦ block(h) (the block adds its own)."""

    def __init__(self, block: nn.Module, skip: bool):
        self.block, self.skip = block, skip

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.block(h) if self.skip else self.block(h)


def stream_of(model, adapter: Adapter | None = None) -> ResidualStream:
    """The model's residual stream: its own `.stream()`, or the one `adapter` describes."""
    if adapter is None:
        if isinstance(model, ResidualStream):
            return model
        if callable(getattr(model, "stream", None)):
            stream = model.stream()
            if isinstance(stream, ResidualStream):
                return stream
        raise CreditAuditError(
            f"a {type(model).__name__} exposes no residual stream: pass adapter=creditaudit.Adapter("
            "embed=..., blocks=..., readout=...) naming its modules (docs/YOUR_OWN_LOOP.md)")
    if not isinstance(adapter, Adapter):
        raise CreditAuditError(f"adapter must be a creditaudit.Adapter, got {type(adapter).__name__}")
    blocks = block_modules(model, adapter)
    if not blocks:
        raise CreditAuditError("the adapter's blocks are empty: a model without residual blocks "
                               "has no depth to audit")
    if adapter.stream is not None:
        stream = adapter.stream(model)
        if not isinstance(stream, ResidualStream):
            raise CreditAuditError(f"Adapter(stream=...) must return a creditaudit.ResidualStream, "
                                   f"got {type(stream).__name__}")
        return stream
    return ResidualStream(embed=_part(model, adapter.embed, "embed"),
                          steps=[_Step(b, adapter.skip) for b in blocks],
                          readout=_part(model, adapter.readout, "readout"),
                          branches=list(blocks) if adapter.skip else None)


@torch.no_grad()
def check_residual(stream: ResidualStream, x: torch.Tensor, y: torch.Tensor) -> None:
    """Refuse, with one line, a stream the protocol cannot measure: blocks that change the
    stream's shape (not residual), or a readout that does not give one logit row per sample. A
    stream that says it has no skips (`residual = False`, the plain MLP) may change width at
    every layer, never its batch (h_0 = x of D_in features, h_1 … h_L of the hidden width)."""
    try:
        h = stream.embed(x)
    except Exception as err:  # noqa: BLE001 — the user's module failing on its own input is theirs to fix
        raise CreditAuditError(f"the embedding failed on the eval batch ({type(err).__name__}: {err}); "
                               "check the adapter's embed and the eval batch's shape") from None
    shape = tuple(h.shape)
    for l, step in enumerate(stream.steps):
        try:
            nxt = step(h)
        except Exception as err:  # noqa: BLE001
            raise CreditAuditError(f"residual block {l} failed on h_{l} of shape {shape} "
                                   f"({type(err).__name__}: {err}); a residual block must map the "
                                   "stream to a tensor of the same shape — the model is not residual "
                                   "there, or the adapter names the wrong modules") from None
        # a plain network (no skip) may change its per-sample width, never the batch
        if tuple(nxt.shape) != shape and (stream.residual or nxt.shape[:1] != shape[:1]):
            raise CreditAuditError(f"block {l} changes the residual stream's shape from {shape} to "
                                   f"{tuple(nxt.shape)}: the protocol needs h_{{l+1}} = h_l + f_l(h_l) "
                                   "of one shape — the model is not residual there, or the adapter "
                                   "names the wrong modules")
        h, shape = nxt, tuple(nxt.shape)
    logits = stream.readout(h)
    if logits.dim() != 2 or logits.shape[0] != len(y):
        raise CreditAuditError(f"the readout gives shape {tuple(logits.shape)} for {len(y)} samples; "
                               "it must give logits (N, C) — check the adapter's readout")
    if len(y) and (int(y.min()) < 0 or int(y.max()) >= logits.shape[1]):
        raise CreditAuditError(f"eval labels range over {int(y.min())}…{int(y.max())} but the model "
                               f"has {logits.shape[1]} classes")


# the stream must give model(x) to this tolerance (|stream − model| ≤ ATOL + RTOL·|model(x)|,
# elementwise): float32 re-association of the same sums stays orders of magnitude inside it; a
# half-precision model (fp16/bf16 logits) gets HALF_RTOL/HALF_ATOL, its own rounding being ~1e-3
RTOL, ATOL = 1e-4, 1e-5
HALF_RTOL, HALF_ATOL = 1e-2, 1e-3


def _rebuilt(model: nn.Module, adapter: Adapter, skip: bool) -> ResidualStream | None:
    """The adapter's stream with `skip` set, or None when it cannot be built."""
    try:
        return stream_of(model, Adapter(adapter.blocks, adapter.embed, adapter.readout, skip))
    except CreditAuditError:
        return None


@torch.no_grad()
def check_reproduces(model: nn.Module, stream: ResidualStream, x: torch.Tensor,
                     adapter: Adapter | None = None) -> None:
    """The adapter proves itself: its stream, readout(steps(embed(x))), must reproduce the model's
    own forward model(x) on the eval batch to RTOL = 1e-4, ATOL = 1e-5 (float32; 1e-2 / 1e-3 for
    float16/bfloat16 logits). Otherwise every measurement would be of another network than the one
    trained, so this is one line saying which part differs — the shape, or the values by how much,
    with `Adapter(skip=False)` suggested when the blocks add their own skip (and `skip=True` in
    the opposite case), found by trying the flipped stream. A model without a forward of x alone
    (it raises NotImplementedError, or TypeError for a forward that needs more arguments, or it
    returns no tensor, e.g. a dict) has nothing to compare with: the check is skipped."""
    try:
        direct = model(x)
    except (NotImplementedError, TypeError):
        return
    except Exception as err:  # noqa: BLE001 — the user's forward failing on its own batch is theirs to fix
        raise CreditAuditError(f"model(x) raised {type(err).__name__} on the eval batch: "
                               f"{' '.join(str(err).split())[:200]}; give an eval batch the model's "
                               "forward accepts") from None
    if not isinstance(direct, torch.Tensor):
        return
    streamed = stream.forward_from(0, stream.embed(x))
    if tuple(streamed.shape) != tuple(direct.shape):
        raise CreditAuditError(f"the adapter's stream gives logits of shape {tuple(streamed.shape)} but "
                               f"model(x) returns {tuple(direct.shape)}; check the adapter's readout "
                               "(it must end where the model's forward ends)")
    half = direct.dtype in (torch.float16, torch.bfloat16)
    rtol, atol = (HALF_RTOL, HALF_ATOL) if half else (RTOL, ATOL)
    ref, got = direct.float(), streamed.float()
    if torch.isclose(got, ref, rtol=rtol, atol=atol, equal_nan=True).all():
        return
    diff = float((got - ref).abs().nan_to_num(float("inf")).max())
    hint = ("check the adapter's embed, blocks and readout: the stream must compute what the forward "
            "computes (embed → every block in order → readout, a final norm or pooling included)")
    if adapter is not None and adapter.stream is None:
        flipped = _rebuilt(model, adapter, not adapter.skip)
        if flipped is not None:
            other = flipped.forward_from(0, flipped.embed(x)).float()
            if torch.isclose(other, ref, rtol=rtol, atol=atol, equal_nan=True).all():
                hint = ("the blocks seem to add their own skip: pass Adapter(skip=False)" if adapter.skip
                        else "the blocks seem to be residual branches without their skip: pass "
                             "Adapter(skip=True)")
    raise CreditAuditError(f"the adapter's stream does not reproduce model(x): its logits differ by up "
                           f"to {diff:.3g} (tolerance {atol:g} + {rtol:g}·|logit|); {hint}")
