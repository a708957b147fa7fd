"""Run folders: the one place that builds a run's model and method and reads a run folder back.

    RUN/config.json        the resolved RunConfig
    RUN/checkpoint.json    + checkpoint-eNNNN.safetensors: the last checkpointed epoch (store.py;
                           train.CHECKPOINT_SECONDS says when)
    RUN/metrics.jsonl      one line per checkpointed epoch (epoch 0 = at initialisation)
    RUN/status.json        how training ended: finished / stopped / diverged, epochs completed
    RUN/error.txt          the traceback of a run that raised
    RUN/method_origin.json for a user's rule (PKG.MODULE:CLASS): its module, file and sys.path entry,
                           so a command that cannot import it says which PYTHONPATH would
    RUN/diagnosis.json     the latest diagnosis of the run (the audit's, or `creditaudit diagnose`'s),
                           bound to the run it was made of (`run_binding`: run key, checkpoint
                           seal, status digest; `evidence.gate` refuses a copied or stale one)

Nothing here trains or judges; `train.py` writes runs, the experiments read them through `load_run`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import store
from .config import OutdatedRunConfig, RunConfig
from .data import ArrayDataset
from .errors import CreditAuditError
from .evidence import ControlEvidence
from .methods import METHODS, Method, MethodSettings, method_class, method_origin, not_importable
from .methods.rule_code import changed_files, code_of
from .metrics import branch_ratios
from .model import ResidualModel, build_model as build_architecture
from .seeding import seed_everything

DONE = ("finished", "diverged", "stopped")   # statuses of a run that will not train further


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """The command line's device: 'auto' → cuda when available, else cpu; anything else as
    `as_device`. Only the command line calls it: a library function runs where its inputs are
    (the model's or the data's device, or the explicit device it is handed), so that a caller's
    CPU model never meets tensors that a library call put on the GPU."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return as_device(device)


def as_device(device: str | torch.device | None, default: torch.device | None = None) -> torch.device:
    """A library function's device: `device` itself, checked usable here; None → `default` (the
    device of the function's inputs), else the CPU. 'auto' is refused: only the command line
    decides for the GPU (`resolve_device`)."""
    if device is None:
        return torch.device(default) if default is not None else torch.device("cpu")
    if str(device) == "auto":
        raise CreditAuditError("device 'auto' is resolved by the command line only; in Python pass "
                               "the device (cpu, cuda, cuda:N), or none to run where the inputs are")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise CreditAuditError(f"unknown device {device!r}; use cpu, cuda, cuda:N or auto") from None
    if dev.type not in ("cpu", "cuda"):   # meta, xla, …: no tensor there can be read back or trained
        raise CreditAuditError(f"device {device!r} cannot train or measure; use cpu, cuda, cuda:N or auto")
    if dev.type == "cpu" and dev.index is not None:     # torch takes cpu:1, then mixes it with cpu
        raise CreditAuditError(f"device {device!r}: the CPU has no index; use cpu")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CreditAuditError(f"device {device!r} asked for, but this machine has no CUDA GPU; "
                               "use --device cpu (or auto)")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise CreditAuditError(f"device {device!r} asked for, but this machine has "
                               f"{torch.cuda.device_count()} CUDA GPU(s): cuda:0 … "
                               f"cuda:{torch.cuda.device_count() - 1}")
    return dev


def build_model(config: RunConfig, input_shape: tuple[int, ...], n_classes: int) -> ResidualModel:
    """The run's model, initialised from the run's seed."""
    seed_everything(config.seed)
    return build_architecture(config.arch, tuple(input_shape), n_classes, width=config.width,
                              blocks=config.blocks, activation=config.activation,
                              w2_std=config.w2_std, options=dict(config.arch_options))


def build_method(config: RunConfig, model: ResidualModel) -> Method:
    settings = MethodSettings(epochs=config.epochs, seed=config.seed, lr=config.lr,
                              weight_decay=config.weight_decay, clip=config.clip,
                              trainable_blocks=config.trainable_block_ids,
                              options=dict(config.options), batch_size=config.batch_size,
                              recipe=config.resolved_recipe)
    return method_class(config.method)(model, settings)


def run_dir_for(root: Path, config: RunConfig) -> Path:
    """<root>/runs/<method>[-lamλ]-<control>-s<seed>-<key>: readable, and unique per config."""
    lam = f"-lam{config.lam:g}" if config.lam else ""
    method = config.method.replace(":", "_").replace("/", "_")
    return Path(root) / "runs" / f"{method}{lam}-{config.control}-s{config.seed}-{config.run_key}"


@dataclass
class Run:
    """A run folder's content, rebuilt: config, model and method at the last checkpoint, history."""

    config: RunConfig
    run_dir: Path
    model: ResidualModel
    method: Method | None          # None when loaded with method=False (the weights alone)
    history: list[dict] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)    # the checkpoint's remaining state (RNGs)
    shape: dict[str, Any] = field(default_factory=dict)    # the data's input_shape and n_classes
    init_weights: str | None = None     # digest of the seed's initial weights (`weights_digest`)

    @property
    def test_acc(self) -> float | None:
        return self.history[-1]["test_acc"] if self.history else None

    @property
    def epochs_completed(self) -> int:
        return int(self.history[-1]["epoch"]) if self.history else 0

    @property
    def finished(self) -> bool:
        return self.status.get("status") == "finished"


ORIGIN_FILE = "method_origin.json"       # where a user's rule (PKG.MODULE:CLASS) was imported from


def record_method_origin(run_dir: Path, method: str) -> None:
    """For a user's rule, write where it was imported from into its run folder (`ORIGIN_FILE`),
    with the code it trains with ("code": {path: sha256} of the rule's module and every module of
    its package it imports, `methods.rule_code`); for a built-in rule whose code an imported module
    replaced (`foreign_code`), which of its functions came from where — so the run is never taken
    for the project's own rule."""
    if method_class(method) is not METHODS.get(method):
        store.atomic_write_json(Path(run_dir) / ORIGIN_FILE, {**method_origin(method), "code": code_of(method)})
    elif foreign_code(METHODS[method]):
        store.atomic_write_json(Path(run_dir) / ORIGIN_FILE,
                                {"method": method, "patched": foreign_code(METHODS[method])})

def rule_code_change(run_dir: Path, method: str, unrecorded: bool = True) -> str | None:
    """Why the user's rule `method` now runs other code than the run in `run_dir` was trained with
    (the files that changed), or None when it runs the same code, or is a built-in rule. A folder
    that records no code (written before creditaudit recorded it) counts as changed, unless
    `unrecorded` is False (reading such a run back stays possible)."""
    if method in METHODS:
        return None
    path = Path(run_dir) / ORIGIN_FILE
    recorded = None
    if path.exists():
        origin = store.read_json(path, "run folder's record of its rule")
        recorded = origin.get("code") if isinstance(origin, dict) else None
    if not isinstance(recorded, dict):
        return ("the run folder does not record the rule's code (an older creditaudit trained it)"
                if unrecorded else None)
    edited = changed_files(recorded, code_of(method))
    if not edited:
        return None
    return f"the rule's code changed since the run was trained ({', '.join(edited)})"


def superseded_by_code(run_dir: Path, config: RunConfig) -> str | None:
    """For a run of a user's rule not trained yet in `run_dir` (an audit's folder, named by its
    key): why a folder beside it holds the same run trained by other code (that is why it trains
    now), or None. The key includes the rule's code, so an edit names a new folder."""
    run_dir = Path(run_dir)
    if config.method in METHODS or (run_dir / "config.json").exists():
        return None
    prefix = run_dir.name[:-len(config.run_key)]
    for other in sorted(run_dir.parent.glob(f"{glob_escape(prefix)}*")):
        try:
            if store.has_checkpoint(other) and \
                    store.read_json(other / "config.json", "run folder") == config.to_dict():
                return rule_code_change(other, config.method)
        except (CreditAuditError, OSError):
            continue
    return None


def glob_escape(text: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in text)


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 of a model's weights (every tensor of its state_dict: name, dtype, shape, bytes).
    At a run's start it is the digest of the initial weights its seed and architecture give
    (`build_model`), recorded in the run folder (checkpoint.json's and status.json's
    "init_weights")."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        if t.is_meta:               # a model built without storage (shape only): nothing to read
            h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0meta".encode())
            continue
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def moved_weights(method: str, where: str) -> CreditAuditError:
    """The one line for a rule that changed the model's weights outside its training steps."""
    return CreditAuditError(
        f"rule {method} changed the model's weights {where}; a rule may change weights only in its "
        "training steps (gradients / train_step), so that every run starts from the initial weights "
        "its seed gives — move that work into the step (or train the model elsewhere and diagnose "
        "it with --model)")


_PACKAGE = Path(__file__).resolve().parent


def foreign_code(cls: type) -> list[str]:
    """"name (file)" for each function of the class `cls` (its own or inherited) whose code lies
    outside the creditaudit package — for a built-in rule, code an imported module patched in;
    empty for the project's own rule as written."""
    out = []
    for name in sorted(dir(cls)):
        attr = getattr(cls, name, None)
        code = getattr(getattr(attr, "__func__", attr), "__code__", None)
        if code is None or name.startswith("__"):
            continue
        file = Path(code.co_filename).resolve()
        if _PACKAGE not in file.parents:
            out.append(f"{name} ({file})")
    return out


def yardstick_evidence(run: Run, x: torch.Tensor, y: torch.Tensor, init_acc: float | None) -> ControlEvidence:
    """What the audit's yardstick run (bp's frozen control of a seed) shows `evidence.gate_yardstick`:
    the checks of a control judged on its own, the untrained model's accuracy `init_acc`, and
    what its rule computes — min_l Γ_l of its method's credit against ∂CE/∂h_l on the probe batch
    (x, y) (1 for backprop), and whether the rule's code, now or when it trained
    (`ORIGIN_FILE`), is the project's own. Measures only; the gate decides."""
    from .metrics import credit_alignment
    ev = dataclasses.replace(control_evidence(None, run, x), role="yardstick", init_acc=init_acc)
    origin = run.run_dir / ORIGIN_FILE
    recorded = store.read_json(origin, "run folder's record of its rule") if origin.exists() else {}
    patched = foreign_code(type(run.method)) or (recorded.get("patched") if isinstance(recorded, dict) else None) \
        or ([f"the rule {recorded.get('method')}"] if isinstance(recorded, dict) and recorded.get("file") else [])
    if patched:
        return dataclasses.replace(ev, mismatch=(
            f"its rule is not the project's {run.config.method}: {', '.join(patched[:3])} came from "
            "outside creditaudit (patched by an imported module)"))
    model = run.model.eval()
    dev = next(model.parameters()).device
    x, y = x.to(dev), y.to(dev)
    gammas = credit_alignment(model, run.method.credit(x, y), x, y)
    return dataclasses.replace(ev, credit_cos=min(gammas) if gammas else float("nan"))


def _check_importable(run_dir: Path, method) -> None:
    """A user's rule that cannot be imported now: one line saying how to make it importable."""
    if not isinstance(method, str) or method in METHODS or ":" not in method:
        return
    try:
        method_class(method)
    except CreditAuditError:
        path = Path(run_dir) / ORIGIN_FILE
        origin = None
        if path.exists():
            try:
                origin = store.read_json(path, "run folder's record of its rule")
            except CreditAuditError:
                origin = None
        raise CreditAuditError(not_importable(method, origin if isinstance(origin, dict) else None)) from None


def read_config(run_dir: Path) -> RunConfig:
    raw = store.read_json(Path(run_dir) / "config.json", "creditaudit run folder")
    if not isinstance(raw, dict):
        raise CreditAuditError(f"{run_dir}/config.json is not a run config; the run folder is corrupt")
    _check_importable(run_dir, raw.get("method"))
    try:
        return RunConfig.from_dict(raw)
    except OutdatedRunConfig as err:
        raise CreditAuditError(f"run folder {run_dir}: {err}") from None


def read_status(run_dir: Path) -> dict[str, Any]:
    """How the run ended ({} while it is still training), integrity-checked against its checkpoint."""
    path = Path(run_dir) / "status.json"
    if not path.exists():
        return {}
    status = store.read_sealed_json(path, "run's status")
    if status.get("checkpoint") != store.checkpoint_digest(run_dir):
        raise CreditAuditError(f"{path} belongs to another checkpoint than {Path(run_dir) / 'checkpoint.json'} "
                               "(one of them was replaced); re-train the run")
    return status


def load_run(run_dir: str | Path, device: str | torch.device | None = None, *, method: bool = True) -> Run:
    """Rebuild a run from its folder (config.json + checkpoint) without unpickling anything, on
    `device` (default: the CPU, where a checkpoint's tensors are read). method=False: the model and
    history alone (`Run.method` None), for a reader of the weights (the evidence gate): no optimiser
    is built, and building one makes torch import torch._dynamo."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CreditAuditError(f"{run_dir} is a file, not a run folder; give the folder `creditaudit train "
                               "--out` wrote" if run_dir.is_file() else f"run folder {run_dir} does not exist")
    config = read_config(run_dir)
    meta, state = store.load_checkpoint(run_dir)
    store.check_metrics_log(run_dir, state["history"], ended=bool(read_status(run_dir)))
    model = build_model(config, tuple(meta["input_shape"]), meta["n_classes"])
    try:
        model.load_state_dict(state.pop("model"))
    except (RuntimeError, KeyError) as err:
        raise CreditAuditError(f"checkpoint in {run_dir} does not fit its config.json ({err})") from None
    model.to(as_device(device))
    # a user's rule edited since the run trained would diagnose weights of other code as its own
    changed = rule_code_change(run_dir, config.method, unrecorded=False)
    if changed:
        raise CreditAuditError(f"{run_dir}: {changed}; its weights are not this code's — retrain it "
                               "(an audit does, into a new folder) or restore the rule's code")
    loaded = weights_digest(model)
    rule = build_method(config, model) if method else None
    try:
        method_state = state.pop("method")
        if rule is not None:
            rule.load_state_dict(method_state)
    except (KeyError, ValueError, RuntimeError, TypeError) as err:
        raise CreditAuditError(f"the method state in {run_dir} does not fit a {config.method!r} run "
                               f"({type(err).__name__}: {err}); the checkpoint is corrupt or foreign") from None
    if weights_digest(model) != loaded:      # the weights read must be the weights diagnosed
        raise moved_weights(config.method, f"when it is built again to read {run_dir} (its __init__ or "
                                           "load_extra_state)")
    history = state.pop("history")
    init_weights = meta.get("init_weights")
    return Run(config, run_dir, model, rule, history, read_status(run_dir), state,
               {"input_shape": meta["input_shape"], "n_classes": meta["n_classes"]},
               init_weights if isinstance(init_weights, str) else None)


def existing_run_is_done(out: Path, config: RunConfig) -> bool:
    """Whether `out` already holds this run, finished; a folder holding another run is refused.

    "This run" is the whole key: settings, resolved method options, stop thresholds, data digest
    and training-code version. `config.data_digest` must be bound (the trainer binds it when it
    loads the data) — an unbound config cannot tell whether the folder trained on the same data.
    """
    if not (Path(out) / "config.json").exists():
        return False
    if config.data_digest is None:
        raise ValueError("existing_run_is_done needs a config bound to its data (RunConfig.bind_data)")
    existing = read_config(out)
    if existing != config:
        differ = [f.name for f in dataclasses.fields(RunConfig)
                  if getattr(existing, f.name) != getattr(config, f.name)]
        raise CreditAuditError(
            f"{out} already holds a different run ({existing.label}, key {existing.run_key}; "
            f"it differs in {', '.join(differ)}); choose another --out or delete that folder")
    # a folder with no checkpoint kept nothing of the old code: it trains anew under the new
    changed = rule_code_change(out, config.method) if store.has_checkpoint(out) else None
    if changed:
        raise CreditAuditError(f"{out} already holds a run of {config.label} trained by other code: "
                               f"{changed}; choose another --out or delete that folder to retrain it")
    return read_status(out).get("status") in DONE


def failure_record(run_dir: Path, err: BaseException, seconds: float) -> dict[str, Any]:
    """A run that raised, as data: its traceback saved to run_dir/error.txt (when writable)."""
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        store.atomic_write_text(Path(run_dir) / "error.txt", traceback.format_exc())
        where = f" (traceback in {Path(run_dir) / 'error.txt'})"
    except OSError:
        where = ""
    message = str(err) if isinstance(err, CreditAuditError) else f"{type(err).__name__}: {err}"
    return {"status": "failed", "message": message + where, "trained": True, "seconds": seconds}


def data_shape(data: ArrayDataset) -> dict[str, Any]:
    """What a checkpoint records about its data so the model can be rebuilt without it."""
    return {"input_shape": list(data.input_shape), "n_classes": data.n_classes}


def canonical_control(config: RunConfig) -> RunConfig:
    """A run with no trainable block (frozen or shallow control), in the one spelling that all
    provably equal runs share: each of the method's `trainable_only_options` (e.g. λ, which enters
    only a trainable block's local loss) is set to its declared value (λ = 0: the control reads
    as unpenalised, which is what it is). Every λ of a penalty sweep thus names the same frozen
    control, trained once (bit-identical to training it under any of the λ: tests/test_train.py).
    Any other config is returned as is."""
    if config.trainable_block_ids:
        return config
    options = {**config.options, **method_class(config.method).trainable_only_options}
    return config if options == config.options else config.replace(options=options)


# the settings a frozen-blocks control must share with the run it controls for
CONTROL_FIELDS = ("method", "dataset", "arch", "seed", "epochs", "batch_size", "lr", "weight_decay",
                  "recipe", "width", "blocks", "activation", "w2_std", "clip", "options", "arch_options",
                  "data_digest", "code_version", "precision")


def _mismatch(config: RunConfig, control: Run) -> str | None:
    """Why `control` is not the frozen control of the run `config` (the first field that differs), or None."""
    if control.config.trainable_blocks != 0 or control.config.blocks == 0:
        return (f"it is a {control.config.control!r} run, not a frozen-blocks control (train one with "
                "`creditaudit train ... --frozen`)")
    mine_c, theirs_c = canonical_control(config.replace(trainable_blocks=0)), canonical_control(control.config)
    for name in CONTROL_FIELDS:
        mine, theirs = getattr(mine_c, name), getattr(theirs_c, name)
        if mine != theirs:
            return f"{name} is {theirs!r} there but {mine!r} here"
    return None


def control_evidence(config: RunConfig | None, control: Run, x: torch.Tensor | None = None) -> ControlEvidence:
    """What the run folder `control` shows as the frozen control of the run `config`, for `evidence.gate`:
    whether it is this run's (same settings, seed, data and code), finished, its blocks equal to
    the initialisation its seed gives, its embedding and readout moved from it, and its weights
    (and its logits on `x`, when given) finite. `config` None: a control judged on its own (the
    audit's shallow control: no blocks, so only its embedding and readout must have trained).
    Measures only; the gate decides."""
    mismatch = None if config is None else _mismatch(config, control)
    where = str(control.run_dir)
    if mismatch is not None:
        return ControlEvidence(where, mismatch=mismatch, finished=control.finished, acc=control.test_acc)
    model = control.model
    init = build_model(control.config, tuple(control.shape["input_shape"]), control.shape["n_classes"])
    start = {n: p.detach() for n, p in init.named_parameters()}
    now = {n: p.detach().cpu() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    blocks = {names[id(p)] for b in model.blocks for p in b.parameters()}
    # a part with no parameters has nothing to train (vacuously moved); with none outside the
    # blocks at all, nothing trained
    rest = [*model.embed_parameters(), *model.head_parameters()]
    moved = lambda params: bool(rest) and (not params or not all(
        torch.equal(now[names[id(p)]], start[names[id(p)]]) for p in params))
    finite = all(bool(p.isfinite().all()) for p in now.values())
    ratio = None
    if finite and x is not None:
        x = x.to(next(model.parameters()).device)
        with torch.no_grad():
            finite = bool(model(x).isfinite().all())
        if finite and len(model.blocks):     # are its blocks the identity (zero-initialised branches)?
            ratio = max(branch_ratios(model, x), default=None)
    return ControlEvidence(
        where, finished=control.finished, acc=control.test_acc, finite=finite, branch_ratio=ratio,
        kind="frozen" if config is not None else control.config.control,
        blocks_at_init=all(torch.equal(now[n], start[n]) for n in blocks),
        # each its own group: a readout trained on an untouched embedding is no yardstick
        embedding_moved=moved(model.embed_parameters()), readout_moved=moved(model.head_parameters()))


RUN_FOLDER_FILES = ("run.json", "config.json", "diagnosis.json", "status.json", "metrics.jsonl")


# the record each experiment seals into its folder, and what the folder then is
EXPERIMENT_RECORDS = {"audit.json": "an audit", "ladder.json": "a ladder", "penalty_sweep.json": "a penalty sweep",
                      "identity_check.json": "an identity check"}


def refuse_a_file_as_folder(out: Path) -> None:
    """--out names the folder a command writes: an existing file there is refused in one line (the
    operating system's own message was "File exists")."""
    if out.exists() and not out.is_dir():
        raise CreditAuditError(f"{out} is a file, not a folder; give --out a new folder (or an existing one)")


def refuse_run_folder(out: Path, what: str = "the audit", own: str = "audit.json") -> None:
    """Folders mean one thing: an experiment never writes into a run folder (a Monitor's or the
    trainer's), or `check RUN` would answer with the experiment instead of the run; nor into the
    folder of another kind of experiment (its record `own` names its own kind), whose runs it would
    re-diagnose under its own settings, replacing what that experiment computed. One line."""
    out = Path(out)
    refuse_a_file_as_folder(out)
    found = next((name for name in RUN_FOLDER_FILES if (out / name).exists()), None)
    if found is not None:
        raise CreditAuditError(f"{out} is a run folder (it holds {found}); {what} writes a folder of its "
                               "own — give out= (--out) a new folder, not a run's")
    other = next((name for name in EXPERIMENT_RECORDS if name != own and (out / name).exists()), None)
    if other is not None:
        raise CreditAuditError(f"{out} is {EXPERIMENT_RECORDS[other]}'s folder (it holds {other}); {what} "
                               "writes a folder of its own — give out= (--out) a new folder")


def refuse_foreign_folder_for_run(out: Path) -> None:
    """A run writes a folder of its own: never into an experiment's folder (`check` on it would then
    judge the stray run instead of the sealed experiment), nor among a folder's other files. Empty,
    new, or a run's own folder (resumed) pass. One line."""
    out = Path(out)
    refuse_a_file_as_folder(out)
    if not out.is_dir() or any((out / name).exists() for name in RUN_FOLDER_FILES):
        return
    record = next((name for name in EXPERIMENT_RECORDS if (out / name).exists()), None)
    if record is not None or (out / "runs").is_dir():
        kind = EXPERIMENT_RECORDS[record] if record else "an experiment"
        raise CreditAuditError(f"{out} is {kind}'s folder (it holds {record or 'runs/'}); a run writes a "
                               "folder of its own — give --out a new folder")
    others = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
    if others:
        raise CreditAuditError(f"{out} already holds other files ({', '.join(others[:3])}"
                               f"{', …' if len(others) > 3 else ''}) and no run; a run writes a folder of its "
                               "own — give --out a new or empty folder, or a run's folder to resume it")


def run_identity(run_dir: Path) -> str | None:
    """What names the run in a folder: a Monitor's run id (run.json), else the run key of its
    config.json; None when the folder holds neither."""
    run_dir = Path(run_dir)
    for name, key in (("run.json", "run_id"), ("config.json", None)):
        path = run_dir / name
        if path.exists():
            raw = store.read_json(path, "run folder")
            if not isinstance(raw, dict):
                return None
            return raw.get(key) if key else read_config(run_dir).run_key
    return None


def diagnosis_binding(run_dir: Path) -> dict[str, Any]:
    """The run a diagnosis of `run_dir` is made of, as it stands now: its identity (run key or run
    id), its checkpoint's seal and its sealed training status (None while it trains). Recorded in
    diagnosis.json (`write_diagnosis`) and compared by `evidence.gate` when the diagnosis is read
    back, as status.json is bound to its checkpoint. A folder of `creditaudit train` is read whole
    first, as a load would read it (config against the sealed checkpoint, the tensors' sha256, the
    status' seal, metrics.jsonl against the sealed history): a diagnosis is never bound to, nor
    read back from, a run whose records were damaged or edited."""
    run_dir = Path(run_dir)
    status = read_status(run_dir)
    if (run_dir / "config.json").exists() and not (run_dir / "run.json").exists():
        read_config(run_dir)
        _, state = store.load_checkpoint(run_dir)
        store.check_metrics_log(run_dir, state["history"], ended=bool(status))
    return {"run": run_identity(run_dir), "checkpoint": store.checkpoint_digest(run_dir),
            "status": store.digest(store.json_safe(status)) if status else None}


def write_diagnosis(run_dir: Path, report: dict, settings: str | None = None) -> None:
    """Seal `report` as <run_dir>/diagnosis.json, bound to the run as it stands now and, from an
    audit, to the digest of the settings it was made with (`experiments.common.diagnosis_settings`)."""
    store.write_sealed_json(Path(run_dir) / "diagnosis.json",
                            {**report, "run_binding": diagnosis_binding(run_dir),
                             **({"settings_binding": settings} if settings else {})})
