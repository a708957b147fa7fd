"""The Ray executor (runner/ray.py) against the local one, on tiny digits runs and one local Ray
instance for the whole module: equal numbers, reuse across executors, a killed worker resumed
bit-identically, a failing run recorded, Ctrl-C, and the one-line error without Ray."""
import json
import math
import os
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from safetensors.torch import load_file  # noqa: E402

from creditaudit.cli import main as cli_main  # noqa: E402
from creditaudit.config import AuditConfig, RunConfig  # noqa: E402
from creditaudit.errors import CreditAuditError  # noqa: E402
from creditaudit.experiments import audit  # noqa: E402
from creditaudit.experiments.common import Job, train_job  # noqa: E402
from creditaudit.runner import make_executor  # noqa: E402
from creditaudit.runner.ray import RayExecutor  # noqa: E402
from creditaudit.train import CHECKPOINT_ENV  # noqa: E402

HELPERS = "ca_ray_helpers"          # a user package the Ray workers import from PYTHONPATH
BAD_METHOD = f"{HELPERS}.mod:BadMethod"
MODEL = {"width": 16, "blocks": 2}

HELPER_FILES = {
    "__init__.py": "",
    # Light helpers (no torch): a worker that runs them starts fast.
    "light.py": '''
        import os, time

        def record_pid(path):
            with open(path, "a") as f:
                f.write(f"{os.getpid()}\\n")

        def square(x):
            return {"status": "finished", "value": x * x}

        def raises(x):
            if x == 1:
                raise ValueError("job 1 raises on purpose")
            return {"status": "finished", "value": x}

        def dies(path):
            record_pid(path)
            os._exit(1)

        def sleeps(path):
            record_pid(path)
            time.sleep(600)          # far longer than a loaded machine takes to start a worker
            return {"status": "finished"}
    ''',
    "mod.py": '''
        import json, os
        from creditaudit.experiments.common import train_job
        from creditaudit.methods.bp import BP

        class BadMethod(BP):
            """bp whose training step raises: every run of it fails inside the worker."""
            name = "bad"

            def train_step(self, x, y):
                raise RuntimeError("BadMethod.train_step raises on purpose")

        def train_job_reporting_pid(job):
            """train_job, after appending "PID EPOCH" (the checkpoint epoch it starts from)."""
            try:
                with open(os.path.join(job.run_dir, "checkpoint.json")) as f:
                    epoch = json.load(f)["epoch"]
            except (OSError, ValueError, KeyError):
                epoch = -1
            with open(job.run_dir + ".pids", "a") as f:
                f.write(f"{os.getpid()} {epoch}\\n")
            return train_job(job)
    ''',
}


@pytest.fixture(scope="module")
def ray_instance(tmp_path_factory):
    """One local Ray instance (2 CPUs) for the module; its workers see the helper package."""
    root = tmp_path_factory.mktemp("raypkg")
    pkg = root / HELPERS
    pkg.mkdir()
    for name, text in HELPER_FILES.items():
        (pkg / name).write_text(textwrap.dedent(text))
    sys.path.insert(0, str(root))                       # the driver validates the user's method
    pythonpath = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": pythonpath,
                                       CHECKPOINT_ENV: "0"}})    # the kill test waits for epoch 3's
    yield root
    ray.shutdown()
    sys.path.remove(str(root))
    for name in [m for m in sys.modules if m == HELPERS or m.startswith(HELPERS + ".")]:
        del sys.modules[name]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("data"))


def _audit_config(out, executor, data_dir, methods=("bp", "dfa")) -> AuditConfig:
    return AuditConfig(dataset="digits", methods=tuple(methods), seeds=(42,), epochs=2, out=str(out),
                       data_dir=data_dir, device="cpu", jobs=1, executor=executor, model=dict(MODEL))


# -- 1, 2: the same numbers, and reuse across executors ------------------------------------------
SKIP = {"wall_time", "created", "run_dir", "trained_now", "paths", "seconds"}


def _diffs(a, b, where="") -> list[str]:
    """Where two audit.json fragments differ; numbers must be exactly equal (NaN equals NaN)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) - SKIP != set(b) - SKIP:
            return [f"{where}: keys {sorted(set(a) ^ set(b))}"]
        return [d for k in sorted(set(a) - SKIP) for d in _diffs(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diffs(x, y, f"{where}[{i}]")]
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return []
    return [] if (type(a) is type(b) and a == b) else [f"{where}: {a!r} != {b!r}"]


def _numbers_differ(x: dict, y: dict) -> list[str]:
    diffs = _diffs(x["methods"], y["methods"], "methods")
    assert [r["key"] for r in x["runs"]] == [r["key"] for r in y["runs"]]
    for rx, ry in zip(x["runs"], y["runs"]):
        diffs += _diffs({k: rx[k] for k in ("status", "test_acc", "report")},
                        {k: ry[k] for k in ("status", "test_acc", "report")}, rx["label"])
    return diffs


@pytest.fixture(scope="module")
def audits(ray_instance, tmp_path_factory, data_dir):
    """Folder A audited locally then with Ray; folder B with Ray then locally."""
    a, b = tmp_path_factory.mktemp("audit-a"), tmp_path_factory.mktemp("audit-b")
    return {"local A": audit(_audit_config(a, "local", data_dir), progress=False),
            "ray B": audit(_audit_config(b, "ray", data_dir), progress=False),
            "ray A": audit(_audit_config(a, "ray", data_dir), progress=False),
            "local B": audit(_audit_config(b, "local", data_dir), progress=False)}


def test_ray_audit_numbers_equal_the_local_executors(audits):
    local, on_ray = audits["local A"], audits["ray B"]
    assert local["runs_trained_now"] == on_ray["runs_trained_now"] == 6
    main = [r for r in on_ray["runs"] if r["control"] == "none"]
    assert all(r["status"] == "finished" and r["report"] for r in main)
    assert [m["verdict"] for m in on_ray["methods"]] == [m["verdict"] for m in local["methods"]]
    assert _numbers_differ(local, on_ray) == []


@pytest.mark.parametrize("second, first", [("ray A", "local A"), ("local B", "ray B")])
def test_finished_runs_are_reused_across_executors(audits, second, first):
    assert audits[second]["runs_trained_now"] == 0
    assert not any(r["trained_now"] for r in audits[second]["runs"])
    assert _numbers_differ(audits[first], audits[second]) == []


def test_a_stack_is_one_ray_task_and_equals_the_local_executors(ray_instance, tmp_path, data_dir, monkeypatch):
    """Under --executor ray --stack, each stack is one Ray task asking for one CPU and (on a CPU)
    no GPU, and the audit's numbers equal the local executor's stacks."""
    real, asked, tasks = ray.remote, [], []

    class Named:                               # the remote function, its task names recorded
        def __init__(self, fn):
            self.fn = fn

        def options(self, **kw):
            tasks.append(kw["name"])
            return self.fn.options(**kw)

    def spy(**kw):
        asked.append(kw)
        return lambda fn: Named(real(**kw)(fn))

    monkeypatch.setattr(ray, "remote", spy)
    results = {}
    for executor in ("ray", "local"):
        config = _audit_config(tmp_path / executor, executor, data_dir)
        results[executor] = audit(AuditConfig(**{**config.__dict__, "stack": True}), progress=False)
    on_ray = results["ray"]
    ids = {r["stack"]["id"] for r in on_ray["runs"]}
    assert any(r["stack"]["size"] > 1 for r in on_ray["runs"])
    trained = [t for t in tasks if t.startswith("train_any[")]
    assert sorted(trained) == sorted(f"train_any[{i}]" for i in ids)          # one task per stack
    assert asked and all(kw["num_cpus"] == 1 and kw["num_gpus"] == 0.0 for kw in asked)
    assert [r["stack"] for r in on_ray["runs"]] == [r["stack"] for r in results["local"]["runs"]]
    assert _numbers_differ(results["local"], on_ray) == []


# -- 3: a worker killed mid-run is retried and resumes from its checkpoint -------------------------
def _checkpoint_epoch(run_dir: Path) -> int:
    try:
        return json.loads((run_dir / "checkpoint.json").read_text())["epoch"]
    except (OSError, ValueError, KeyError):
        return -1


def _final_tensors(run_dir: Path) -> dict:
    meta = json.loads((run_dir / "checkpoint.json").read_text())
    return load_file(run_dir / meta["tensors"])


def test_a_killed_worker_is_retried_and_resumes_bit_identically(ray_instance, tmp_path, data_dir):
    from ca_ray_helpers.mod import train_job_reporting_pid
    config = RunConfig(method="bp", dataset="digits", seed=7, epochs=30, **MODEL).to_dict()
    run_dir = tmp_path / "ray" / "run"
    run_dir.parent.mkdir()
    pids = Path(str(run_dir) + ".pids")
    killed: dict = {}

    def kill_once_past_epoch_3():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not killed:
            epoch = _checkpoint_epoch(run_dir)
            if epoch >= 3 and pids.exists():
                pid = int(pids.read_text().split()[0])
                os.kill(pid, signal.SIGKILL)
                killed.update(pid=pid, epoch=epoch)
            time.sleep(0.01)

    killer = threading.Thread(target=kill_once_past_epoch_3, daemon=True)
    killer.start()
    seen = []
    results = RayExecutor(max_retries=2).map(
        train_job_reporting_pid, [Job(config, str(run_dir), data_dir, "cpu", 1)],
        lambda i, r: seen.append(i))
    killer.join(timeout=5)
    assert killed and 3 <= killed["epoch"] < 30, killed
    assert results[0]["status"] == "finished", results
    assert seen == [0]
    attempts = [line.split() for line in pids.read_text().splitlines()]
    assert len(attempts) == 2 and int(attempts[0][0]) == killed["pid"] != int(attempts[1][0])
    assert int(attempts[1][1]) >= killed["epoch"]           # the retry resumed, not restarted
    assert json.loads((run_dir / "status.json").read_text())["status"] == "finished"

    local_dir = tmp_path / "local" / "run"
    assert train_job(Job(config, str(local_dir), data_dir, "cpu", 1))["status"] == "finished"
    resumed, uninterrupted = _final_tensors(run_dir), _final_tensors(local_dir)
    assert sorted(resumed) == sorted(uninterrupted)
    different = [k for k in resumed if not (resumed[k].dtype == uninterrupted[k].dtype
                                            and resumed[k].shape == uninterrupted[k].shape
                                            and bool((resumed[k] == uninterrupted[k]).all()))]
    assert different == []


def test_a_worker_dying_past_its_retries_is_recorded(ray_instance, tmp_path):
    from ca_ray_helpers.light import dies, square
    pids = tmp_path / "pids"
    results = RayExecutor(max_retries=1).map(dies, [str(pids)], lambda i, r: None)
    assert results[0]["status"] == "failed" and results[0]["message"].startswith("worker died:")
    assert len(pids.read_text().split()) == 2                # the first try and one retry
    assert RayExecutor().map(square, [3], lambda i, r: None) == [{"status": "finished", "value": 9}]


# -- 4: a run that raises is recorded; the rest complete ------------------------------------------
def test_a_run_that_raises_is_recorded_and_the_rest_complete(ray_instance, tmp_path, data_dir):
    result = audit(_audit_config(tmp_path, "ray", data_dir, methods=("bp", BAD_METHOD)), progress=False)
    bad = [r for r in result["runs"] if r["method"] == BAD_METHOD]
    good = [r for r in result["runs"] if r["method"] == "bp"]
    assert len(bad) == len(good) == 3
    for r in bad:
        assert r["status"] == "failed" and "raises on purpose" in r["message"]
        assert "BadMethod.train_step raises on purpose" in (Path(r["run_dir"]) / "error.txt").read_text()
    assert all(r["status"] == "finished" for r in good)
    rows = {m["method"]: m for m in result["methods"]}
    assert rows[BAD_METHOD]["verdict"].startswith("incomplete")
    # bp's verdict owes nothing to the failed method (its one seed may still leave (d) undetermined)
    assert not rows["bp"]["missing"] or all(m.startswith("(d) undetermined") for m in rows["bp"]["missing"])
    assert rows["bp"]["depth"]["outcome"] != "not evaluated"


def test_a_task_that_raises_becomes_a_failed_record(ray_instance):
    from ca_ray_helpers.light import raises
    seen = []
    results = RayExecutor().map(raises, [0, 1, 2], lambda i, r: seen.append(i))
    assert sorted(seen) == [0, 1, 2]
    assert results[0] == {"status": "finished", "value": 0} and results[2]["value"] == 2
    assert results[1]["status"] == "failed" and "job 1 raises on purpose" in results[1]["message"]
    text = results[1]["traceback"]                          # the worker's traceback, as text
    assert 'light.py", line' in text and "in raises" in text and "ValueError: job 1 raises" in text


# -- Ctrl-C ---------------------------------------------------------------------------------------
def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_an_interrupt_cancels_the_outstanding_tasks(ray_instance, tmp_path, sig):
    from ca_ray_helpers.light import sleeps
    from creditaudit.runner import _interrupt
    pids = tmp_path / "pids"
    handler_before = signal.getsignal(signal.SIGTERM)

    def interrupt_once_started():
        deadline = time.monotonic() + 300      # worker start-up on a loaded 2-core machine
        while time.monotonic() < deadline:
            ready = pids.exists() and (sig == signal.SIGINT or signal.getsignal(signal.SIGTERM) is _interrupt)
            if ready:
                os.kill(os.getpid(), sig)                    # what Ctrl-C / scancel does to the driver
                return
            time.sleep(0.02)

    # Ctrl-C raises KeyboardInterrupt through Python's default handler; a library an earlier test
    # ran may have left another SIGINT handler in this process (the whole suite swallowed it)
    handler_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=interrupt_once_started, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            RayExecutor().map(sleeps, [str(pids), str(pids)], lambda i, r: None)
    finally:
        signal.signal(signal.SIGINT, handler_int)
    assert signal.getsignal(signal.SIGTERM) is handler_before
    started = [int(p) for p in pids.read_text().split()]
    deadline = time.monotonic() + 20
    while any(map(_alive, started)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_alive, started)), "a cancelled task's worker is still running"
    assert ray.is_initialized()                              # not ours to shut down: the fixture's


def test_runs_asking_for_more_gpus_than_the_cluster_has_are_refused_at_once(ray_instance):
    from ca_ray_helpers.light import square
    with pytest.raises(CreditAuditError, match="asks for 1 GPU but the Ray cluster has 0"):
        RayExecutor(gpus_per_job=1.0).map(square, [1], lambda i, r: None)
    assert ray.is_initialized()                              # the fixture's instance is left alone


def test_an_address_nobody_answers_fails_fast():
    from creditaudit.runner.ray import _check_reachable
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match="does not answer"):
        _check_reachable("127.0.0.1:1")
    assert time.monotonic() - t0 < 5
    _check_reachable("auto")                                 # resolved by Ray itself


# -- 5: without Ray -------------------------------------------------------------------------------
def test_without_ray_make_executor_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)            # `import ray` raises ImportError
    with pytest.raises(CreditAuditError, match=r'pip install "creditaudit\[ray\]"') as err:
        make_executor("ray")
    assert "\n" not in str(err.value)


def test_without_ray_the_cli_prints_one_line_and_exits_2(monkeypatch, tmp_path, capsys, data_dir):
    monkeypatch.setitem(sys.modules, "ray", None)
    code = cli_main(["audit", "--executor", "ray", "--dataset", "digits", "--methods", "bp",
                     "--seeds", "42", "--epochs", "1", "--data-dir", data_dir,
                     "--out", str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and 'pip install "creditaudit[ray]"' in err, err
    assert not (tmp_path / "out" / "runs").exists()
