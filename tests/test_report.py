"""The report is made from the audit dict alone: files, numbers, robustness to missing pieces,
and (where Chromium is installed) that the HTML renders offline."""
import copy
import json
import re
import shutil
import subprocess

import pytest
from PIL import Image

from creditaudit import store
from creditaudit.config import audit_config_from_dict
from creditaudit.experiments import audit as run_audit
from creditaudit.report import audit_table, write_report
from creditaudit.verdict import Verdict

FILES = ("audit.md", "report.html", "norms.png", "monitor.png", "gamma.png", "rho.png", "alignment.png")


@pytest.fixture(scope="module")
def audited(tmp_path_factory):
    """A real (tiny) audit: digits, bp + dfa, 2 seeds, 2 epochs, with its report written."""
    tmp = tmp_path_factory.mktemp("audit")
    config = audit_config_from_dict({"dataset": "digits", "methods": ["bp", "dfa"], "seeds": [1, 2],
                                     "epochs": 2, "out": str(tmp), "model": {"width": 32, "blocks": 2},
                                     "jobs": 1})
    result = run_audit(config, progress=False)
    paths = write_report(result, tmp / "report")
    return result, paths, tmp


def _tables(md):
    """The Markdown tables of a text: lists of consecutive lines starting with "|"."""
    out, current = [], []
    for line in md.splitlines() + [""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            out.append(current)
            current = []
    return out


def _method_lines(md, method):
    """Every table line of `method` (a method's numbers may be spread over several tables)."""
    return "\n".join(line for line in md.splitlines() if line.startswith(f"| {method} "))


def _row(audit, method):
    return next(r for r in audit["methods"] if r["method"] == method)


def _assert_png(path):
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size[0] > 100 and im.size[1] > 100


def test_every_file_is_written_and_pngs_are_valid(audited):
    _, paths, tmp = audited
    assert set(paths) == set(FILES) | {"rules.md"}
    for name in (*FILES, "rules.md"):
        assert paths[name] == tmp / "report" / name and paths[name].stat().st_size > 0
        if name.endswith(".png"):
            _assert_png(paths[name])
    assert not list((tmp / "report").glob(".*.tmp")), "an atomic write left its temporary file"


def test_markdown_holds_methods_verdicts_and_the_audit_numbers(audited):
    result, paths, _ = audited
    md = paths["audit.md"].read_text()
    assert result["header"] in md
    for row in result["methods"]:
        assert f"| {row['method']} " in md
        # the verdicts table shows the heading (an incomplete verdict's missing items follow it,
        # below the table, once); the paper's rule beside it
        from creditaudit.report.tables import headline
        assert headline(row) in md and row["paper_verdict"].split(":")[0] in md
        for missing in row["missing"]:
            assert " ".join(missing.split())[:60] in " ".join(md.split())
        lines = _method_lines(md, row["method"])
        # accuracy over the seeds: the mean and its spread (± std, or a 95 % interval)
        assert f"{100 * row['acc']:.1f}" in lines
        interval = (row.get("acc_interval") or {}).get("t_interval")
        assert (f"{100 * row['acc']:.1f} ± {100 * row['acc_std']:.1f}" in lines or interval and
                f"[{100 * interval[0]:.1f}, {100 * interval[1]:.1f}]" in lines)
        assert f"{100 * row['frozen_acc']:.1f} ± {100 * row['frozen_acc_std']:.1f}" in lines
        assert f"{row['h_L']:.1e}" in lines and f"{row['g_L']:.1e}" in lines
        assert f"{row['gain']:.1e}" in lines
        for reason in row["reasons"]:
            assert reason in md
    dfa = _row(result, "dfa")
    assert f"{dfa['gamma_deep']:+.3f}" in md  # dfa has Γ and a null: the z-score is shown beside it
    z = (dfa["gamma_deep"] - dfa["null_deep_mean"]) / dfa["null_deep_std"]
    assert f"(z {z:+.1f})" in md
    n = len(result["methods"])
    totals = result["strategy_totals"]
    assert f"| walks back | {totals['accuracy only']} of {n}" in md
    assert f"{totals['full protocol']} of {n}" in md
    for name in result["sensitivity"]:
        assert f"| {name} " in md
    for name in FILES[2:]:
        assert f"]({name})" in md  # the figures are linked from the Markdown


def test_table_is_the_same_from_the_live_dict_and_from_audit_json(audited):
    """Results are data first: audit.json read back (NaN → null, inf → "inf") renders identically."""
    result, _, tmp = audited
    from_json = json.loads((tmp / "audit.json").read_text())
    assert audit_table(from_json) == audit_table(result)
    tables = _tables(audit_table(result))
    assert tables, "no table in the audit"
    audit_part = audit_table(result).split("\n## Audit\n")[1].split("\n## ")[0]
    method_tables = [t for t in _tables(audit_part) if len(t) == 2 + len(result["methods"])]
    assert method_tables                                # one row per method
    for t in method_tables:
        assert [line.split("|")[1].strip() for line in t[2:]] == [r["method"] for r in result["methods"]]
    for t in tables:
        assert len({len(line) for line in t}) == 1      # padded to fixed width: readable as text


def test_html_is_self_contained_with_tables_images_and_verdicts(audited):
    result, paths, _ = audited
    page = paths["report.html"].read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.I)
    assert "http://" not in page and "https://" not in page and "<script" not in page.lower()
    assert "url(" not in page  # no CSS resource either
    md = paths["audit.md"].read_text()
    assert page.count("<table") == len(_tables(md)) and "<table class=\"audit\">" in page
    images = re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)" alt="([^"]+)"', page)
    assert len(images) == len(FILES) - 2 and all(alt for _, alt in images)
    for row in result["methods"]:
        assert f"<td>{row['method']}</td>" in page
        cls = ("ok " if row["verdict"] == "trustworthy" else
               "bad " if row["verdict"].startswith("walk back") else "warn ")
        from creditaudit.report.tables import headline
        assert f'<td class="{cls}wrap">{html_escape(headline(row))}</td>' in page
        for seed in row["per_seed"].values():               # per seed: coloured by the structured verdict
            outcome = seed["verdicts"]["project"]["outcome"]
            cls = {"trustworthy": "ok ", "walk back": "bad ", "incomplete": "warn "}[outcome]
            assert f'<td class="{cls}wrap">{html_escape(seed["verdict"])}</td>' in page


def _degenerate(result):
    """The dfa row as an exploded run would give it (values from the paper's seed-42 DFA)."""
    audit = store.json_safe(copy.deepcopy(result))
    dfa = _row(audit, "dfa")
    project = Verdict("project", "walk back", ("a", "b_prime", "d"))
    paper = Verdict("paper", "walk back", ("a", "b", "d"))
    dfa.update(h_L=4e8, g_L=4.18e-9, gain=1.0e-4, max_growth="inf", gamma_interpretable=False,
               first_fire={"a": [8, None], "b": [3, 4], "b_prime": [2, 2]},
               verdict=project.text, paper_verdict=paper.text,
               verdicts={"project": project.to_dict(), "paper": paper.to_dict()})
    assert dfa["verdict"] == "walk back: (a) EXPLODED, (b′) ATTENUATED, (d) UNDERCUT"
    for run in audit["runs"]:
        if run["method"] == "dfa" and run["control"] == "none":
            for r in run["monitor"]:
                r["max_growth"] = 10.0 ** (r["epoch"] + 1)
                r["gain"] = 10.0 ** -(r["epoch"] + 1)
                r["g_norms"][-1] = "inf" if r["epoch"] == 0 else 1e-9
            run["report"]["first_fire"] = {"a": 2, "b": 1, "b_prime": 2}
    return audit


def test_degenerate_values_are_formatted_compactly(audited, tmp_path):
    result, _, _ = audited
    audit = _degenerate(result)
    md = audit_table(audit)
    dfa_line = _method_lines(md, "dfa")
    assert "4.0e+08" in dfa_line and "4.2e-09" in dfa_line and "1.0e-04" in dfa_line
    assert "| inf " in dfa_line
    assert f"{_row(result, 'dfa')['gamma_deep']:+.3f}*" in dfa_line  # Γ marked uninterpretable
    assert "a: 8/—; b: 3/4; b′: 2/2" in dfa_line
    paths = write_report(audit, tmp_path)
    for name in FILES[2:]:
        _assert_png(paths[name])


def test_missing_and_failed_pieces_still_render(audited, tmp_path):
    result, _, _ = audited
    audit = store.json_safe(copy.deepcopy(result))
    dfa = _row(audit, "dfa")
    for key in dfa:
        if key != "method":
            dfa[key] = None
    audit["sensitivity"] = None
    audit["strategy_totals"] = {}
    bp_main = [r for r in audit["runs"] if r["method"] == "bp" and r["control"] == "none"]
    for run in bp_main:  # every main run of bp failed: no report, no monitor
        run.update(status="failed", message="RuntimeError: boom (traceback in x/error.txt)",
                   report=None, monitor=[], test_acc=None)
    dfa_main = next(r for r in audit["runs"] if r["method"] == "dfa" and r["control"] == "none")
    dfa_main["monitor"][1]["gain"] = None
    dfa_main["report"]["residual_norms"] = [None, "inf", 3.0]
    paths = write_report(audit, tmp_path)
    assert set(paths) == set(FILES) | {"rules.md"}
    rules = paths["rules.md"].read_text()
    assert all(f"| {row['method']} " in rules for row in audit["methods"])
    for name in FILES[2:]:
        _assert_png(paths[name])
    md = paths["audit.md"].read_text()
    dfa_line = next(line for line in md.splitlines() if line.startswith("| dfa "))
    assert set(dfa_line.strip("| ").split("|")[1].split()) == {"—"}
    assert md.count("RuntimeError: boom") == len(bp_main) and "bp/s1 (failed)" in md
    assert "(not available" in md
    page = paths["report.html"].read_text()
    assert "RuntimeError: boom" in page and page.count("data:image/png;base64,") == len(FILES) - 2   # every PNG inlined


def test_an_empty_audit_renders(tmp_path):
    paths = write_report({}, tmp_path)
    assert "(no methods)" in paths["audit.md"].read_text()
    assert "**No method was audited.**" in paths["audit.md"].read_text()
    for name in FILES[2:]:
        _assert_png(paths[name])


CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def test_html_renders_offline_in_chromium(audited, tmp_path):
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("Chromium not installed (Debian package 'chromium'; .ci/run installs it)")
    result, paths, _ = audited
    url = paths["report.html"].resolve().as_uri()
    shot = tmp_path / "shot.png"
    flags = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}"]
    done = subprocess.run([*flags, f"--screenshot={shot}", "--window-size=1400,1800", url],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert shot.exists()
    with Image.open(shot) as im:
        colors = im.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colors is not None and len(colors) > 50, "the screenshot is (nearly) blank"
    white = max((n for n, c in colors if c == (255, 255, 255)), default=0)
    assert white < 0.97 * sum(n for n, _ in colors)

    dom = subprocess.run([*flags, "--dump-dom", url], capture_output=True, text=True, timeout=60)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert "<table class=\"audit\">" in dom.stdout and "Reporting strategies" in dom.stdout
    assert dom.stdout.count("<img") == len(FILES) - 2
    for row in result["methods"]:
        from creditaudit.report.tables import headline
        assert f"<td>{row['method']}</td>" in dom.stdout and html_escape(headline(row)) in dom.stdout
        for missing in row["missing"]:       # what an incomplete verdict lacks, said below the table
            assert html_escape(" ".join(missing.split()))[:60] in " ".join(dom.stdout.split())


def html_escape(text):
    import html
    return html.escape(text, quote=False)


def test_compact_table_fits_a_terminal_and_names_each_method(audited):
    """≤ 120 columns; a verdict too long for its column wraps, never cut, and each method's full
    verdicts — the text that explains an "incomplete" — follow the table in full, wrapped, never cut."""
    from creditaudit.report import compact_table
    result, _, _ = audited
    text = compact_table(result)
    lines = text.splitlines()
    assert all(len(line) <= 120 for line in lines)
    top = next(i for i, line in enumerate(lines) if line.startswith("method "))
    assert lines[0].startswith(f"Of {len(result['methods'])} methods, ")
    table = lines[top:top + 2 + len(result["methods"])]
    for row, line in zip(result["methods"], table[2:]):
        assert line.startswith(row["method"]) and f"{100 * row['acc']:.1f}" in line
    below = " ".join(" ".join(line.split()) for line in lines[top + 2 + len(result["methods"]):])
    for row in result["methods"]:
        heading = "incomplete" if row["verdict"].startswith("incomplete") else row["verdict"]
        assert f"{row['method']}: {' '.join(heading.split())}" in below
        for item in row.get("reasons") or []:
            assert " ".join(item.split()) in below
        assert "paper's rule: " in below
    assert "median over seeds" in below            # which cells are medians, and that reasons quote a seed
    wide = compact_table(_degenerate(result))
    assert "walk back: (a), (b′), (d)" in " ".join(wide.split())   # flag names shortened to fit
    narrow = compact_table(_degenerate(result), width=80)
    assert all(len(line) <= 80 for line in narrow.splitlines())
    assert "…" not in narrow
    row = narrow.splitlines().index(next(l for l in narrow.splitlines() if l.startswith("dfa ")))
    cell = " ".join(l.strip() for l in narrow.splitlines()[row:row + 3])
    assert "walk back: (a), (b′), (d)" in cell                  # the verdict cell wraps onto its next lines
    assert "dfa: walk back: (a) EXPLODED, (b′) ATTENUATED, (d) UNDERCUT" in narrow.replace("\n    ", " ")
    assert compact_table({}) == "(no methods)"


def test_audit_json_carries_deep_gamma_and_the_alignment_series(audited):
    """Each main run's monitor lines carry Γ_l over training; each method row the series' mean
    over seeds; bp's deep Γ is n/a (every position exact), dfa's keeps every position; the
    report shows the paper's deep Γ beside the project's and draws alignment.png."""
    result, paths, _ = audited
    for run in result["runs"]:
        if run["control"] == "none":
            assert [len(r["gamma"]) for r in run["monitor"]] == [3, 3, 3], run["label"]
    bp, dfa = _row(result, "bp"), _row(result, "dfa")
    for row in (bp, dfa):
        assert row["alignment"]["epochs"] == [0, 1, 2] and row["alignment"]["seeds"] == [2, 2, 2]
        assert row["alignment"]["weight_alignment"] == {}             # neither has feedback weights
    assert bp["gamma_exact"] == [0, 1, 2] and bp["gamma_deep_exact"] and bp["gamma_deep"] is None
    assert bp["gamma_deep_paper"] == pytest.approx(1.0)
    assert all(g == pytest.approx(1.0) for e in bp["alignment"]["gamma"] for g in e)
    assert dfa["gamma_exact"] == [] and dfa["gamma_deep"] == pytest.approx(dfa["gamma_deep_paper"])
    credit = next(t for t in _tables(paths["audit.md"].read_text()) if "paper's deep Γ" in t[0])
    assert "n/a (exact by construction)" in next(line for line in credit if line.startswith("| bp "))
    _assert_png(paths["alignment.png"])


def test_rows_that_print_the_same_get_a_note_with_the_full_precision_difference(audited):
    """The table hides what it measures when two methods agree to the printed digits (EP at β = 1
    on a mean CE against BP): a note says so, and gives the full-precision differences."""
    result, _, _ = audited
    audit = store.json_safe(copy.deepcopy(result))
    bp = _row(audit, "bp")
    assert bp["gamma_deep"] is None and bp["gamma_deep_exact"]     # bp: n/a (exact by construction)
    bp.update(gamma_deep=0.9512, gamma_deep_exact=False)            # as a rule that declares none
    twin = copy.deepcopy(bp)
    twin.update(method="twin", acc=bp["acc"] + 1e-5, gamma_deep=bp["gamma_deep"] - 2e-4)
    audit["methods"].append(twin)
    md = audit_table(audit)
    note = next(line for line in md.splitlines() if line.startswith("- note: bp and twin print the same"))
    assert "accuracy 0.001 points" in note and "deep Γ 0.0002" in note
    assert "- note: bp and dfa" not in md                         # rows that differ get none
    twin["gamma_deep"] = bp["gamma_deep"] - 2e-3                  # visible at 3 decimals: no note
    assert "print the same" not in audit_table(audit)
    assert f"{bp['gamma_deep']:+.3f}" in md                        # Γ to 3 decimals


def test_figures_keep_methods_apart_when_their_curves_coincide(audited):
    """bp and a method whose monitor is identical to bp's (EP at a small nudge) get different line
    styles, markers and x offsets in monitor.png; overlapping Γ null bands get different hatches."""
    from creditaudit.report.figures import gamma_figure, monitor_figure
    result, _, _ = audited
    audit = store.json_safe(copy.deepcopy(result))
    twin_runs = [dict(copy.deepcopy(r), method="twin") for r in audit["runs"]
                 if r["method"] == "bp" and r["control"] == "none"]
    audit["runs"] += twin_runs
    dfa = _row(audit, "dfa")
    audit["methods"].append(dict(copy.deepcopy(dfa), method="fa"))
    audit["methods"].append(dict(copy.deepcopy(_row(audit, "bp")), method="twin"))
    ax = monitor_figure(audit).axes[3]
    lines = {}
    for line in ax.get_lines():
        lines.setdefault(line.get_color(), line)
    styles = {(str(l.get_linestyle()), l.get_marker(), float(l.get_xdata()[0])) for l in lines.values()
              if len(l.get_xdata()) > 1}
    assert len(styles) == 3                        # bp, dfa and the twin: three distinct looks
    bands = [c for c in gamma_figure(audit).axes[0].collections if c.get_hatch()]
    assert len(bands) == 2 and bands[0].get_hatch() != bands[1].get_hatch()


def _three_verdicts(result):
    """bp as audited but trustworthy, dfa walking back (`_degenerate`), and a third method incomplete."""
    audit = _degenerate(result)
    bp = _row(audit, "bp")
    ok = Verdict("project", "trustworthy")
    bp.update(verdict=ok.text, verdicts={"project": ok.to_dict(), "paper": ok.to_dict()})
    third = copy.deepcopy(bp)
    missing = Verdict("project", "incomplete", missing=("(d) not evaluated",))
    third.update(method="third", verdict=missing.text,
                 verdicts={"project": missing.to_dict(), "paper": missing.to_dict()})
    audit["methods"].append(third)
    return audit


def test_the_report_says_first_how_many_walk_back_and_what_the_verdicts_mean(audited):
    """Every view (audit.md, report.html, the terminal) opens with the count of each verdict, says
    that "trustworthy" means face value, not "this method works", and defines "walk back" before
    any table uses it."""
    from creditaudit.report import compact_table, report_html
    result, _, _ = audited
    audit = _three_verdicts(result)
    summary = "Of 3 methods, 1 walks back, 1 is trustworthy, 1 is incomplete (project verdict)."
    md, text, page = audit_table(audit), compact_table(audit), report_html(audit, {})
    assert text.splitlines()[0] == summary
    assert f"**{summary}**" in md and f'<p class="summary">{summary}</p>' in page
    for view, first_table in ((md, "\n| method"), (text, "\nmethod "), (page, "<table")):
        flat = " ".join(view.split())
        assert "taken at face value" in flat and "It does not mean the method works" in flat
        start = view.index(first_table)
        head = " ".join(view[:start].split())
        assert summary in head                                   # the count comes first
        assert re.search(r"walk back(\*\*: |: |</dt><dd>)a flag fired", head)   # defined before the tables
        assert "trustworthy" in head and "incomplete" in head
    one = store.json_safe(copy.deepcopy(audit))
    one["methods"] = one["methods"][1:2]
    assert compact_table(one).splitlines()[0] == "Of 1 method, 1 walks back, 0 are trustworthy, 0 are incomplete (project verdict)."


def test_a_gamma_marked_uninterpretable_shows_no_z(audited):
    """Where (b) or (b′) fired, Γ against its null is no evidence: its z is not printed (the cell
    says "z n/a*"), and the HTML greys the Γ cells; an interpretable Γ keeps its z."""
    from creditaudit.report import report_html
    from creditaudit.report.tables import calibration_table
    result, _, _ = audited
    dfa = _row(result, "dfa")
    assert dfa["null_deep_std"] and dfa["null_deep_std"] > 0
    audit = _degenerate(result)                                 # dfa: Γ uninterpretable
    line = next(l for l in _method_lines(audit_table(audit), "dfa").splitlines() if "± " in l and "*" in l)
    assert "(z n/a*)" in line and not re.search(r"\(z [+-]\d", line)
    page = report_html(audit, {})
    assert re.search(r'<td class="na">[+-]\d\.\d{3}\*</td><td class="na">[^<]*\(z n/a\*\)</td>', page)
    fine = store.json_safe(copy.deepcopy(result))
    assert re.search(r"\(z [+-]\d", _method_lines(audit_table(fine), "dfa"))
    page = report_html(fine, {})
    assert not re.search(r'<td class="na">[+-]\d', page)        # no measured Γ greyed
    assert '<td class="na">n/a (exact by construction)</td>' in page   # bp: Γ = 1 by construction
    report = {"label": "x", "verdict": "walk back: (b′) ATTENUATED", "bp_grad_norms": [1e-3, 1e-3],
              "gamma": [0.5, 0.4], "gamma_z": [6.0, 5.0], "gamma_interpretable": False,
              "null": {"mean": [0.0, 0.0], "std": [0.05, 0.05]}, "rho": [], "nudge": []}
    table = calibration_table(report)
    assert "n/a*" in table and "| 6 " not in table and "6.00" not in table
    report["gamma_interpretable"] = True
    assert "| 6 " in calibration_table(report)


def test_a_diagnosis_printout_gives_no_z_for_an_uninterpretable_gamma(digits_batches):
    """`creditaudit diagnose`'s table: z beside an interpretable Γ, "n/a*" beside one marked
    uninterpretable."""
    import dataclasses
    import torch
    import torch.nn.functional as F
    from creditaudit.model import ResidualMLP
    from creditaudit.protocol import diagnose
    torch.manual_seed(0)
    model = ResidualMLP(64, d=16, n_blocks=2)

    class RandomFeedback:
        random_feedback = True

        def credit(self, x, y):
            return self.fresh_feedback_credit(x, y, torch.Generator().manual_seed(0))

        def fresh_feedback_credit(self, x, y, gen):
            e = model(x).softmax(-1) - F.one_hot(y, 10).float()
            return [e.detach() @ torch.randn(10, 16, generator=gen) for _ in range(3)]

    r = diagnose(model, digits_batches, method=RandomFeedback(), null_k=3)
    rows = lambda report: [l for l in str(report).splitlines() if re.match(r"\s+[0-2]  ", l)]
    assert len(rows(r)) == 3 and r.gamma_interpretable and all(re.search(r"[+-]\d+\.\d$", l) for l in rows(r))
    bad = dataclasses.replace(r, gamma_interpretable=False)
    assert all(l.endswith("n/a*") for l in rows(bad)) and "no z against the null" in str(bad)


@pytest.fixture
def digits_batches():
    from creditaudit.data import load_dataset
    data = load_dataset("digits")
    return [data.eval_batch(i, 45) for i in range(2)]


def test_the_depth_margin_is_said_in_points_everywhere():
    """(d)'s margin is "2 points" in the thresholds table and its legend, as in every verdict; its
    interval too — never the fraction 0.02 beside "+2-point margin" elsewhere."""
    from creditaudit.report.tables import _flag_lines, sensitivity_table
    text = sensitivity_table({"depth_margin": {"current": 0.02, "fires_when": "upper bound < threshold",
                                               "interval": [-0.0153, 0.0438], "interval_shape": "(lo, hi]",
                                               "n_fired": 0, "n_spared": 1, "n_unmeasured": 0}})
    row = next(l for l in text.splitlines() if l.startswith("| depth_margin"))
    assert "2 points" in row and "(-1.53, 4.38] points" in row and "0.02" not in row
    lines = _flag_lines({"thresholds": {"depth_margin": 0.02}, "flag_table": [
        {"name": "(d)", "statistics": [{"name": "gap", "fires_when": "gap < threshold", "threshold": "depth_margin"}]}]})
    assert "gap < 2 points (`depth_margin`)" in lines[0]


def test_the_terminal_ends_with_what_to_do_next_for_its_outcome(audited):
    """One closing line per outcome: walk back → the report and `thresholds`; incomplete for want
    of seeds → the seeds to add; all trustworthy → `check` for CI."""
    from creditaudit.report import compact_table
    result, _, _ = audited
    audit = _three_verdicts(result)
    last = lambda a: " ".join(compact_table(a, out="audits/x").split("\n\n")[-1].split())
    assert last(audit).startswith("next: open audits/x/report.html") and "`creditaudit thresholds audits/x`" in last(audit)
    trusted = store.json_safe(copy.deepcopy(audit))
    trusted["methods"] = [_row(trusted, "bp")]
    assert last(trusted).startswith("next: `creditaudit check audits/x`")
    undecided = store.json_safe(copy.deepcopy(trusted))
    row = undecided["methods"][0]
    # the estimate is read from the decision (depth.seeds_needed), not from its sentence
    row.update(verdict="incomplete: (d) undetermined", missing=["(d) undetermined: …"],
               depth={**row["depth"], "outcome": "undetermined", "seeds_needed": 9},
               verdicts={"project": Verdict("project", "incomplete", missing=("(d) undetermined",)).to_dict()})
    undecided["config"] = {**(undecided.get("config") or {}), "seeds": [7]}
    assert last(undecided) == ("next: add seeds to decide (d) for bp: --seeds 7 8 9 10 11 12 13 14 15 "
                               "(9 seeds: likely to decide it if the true gap lies 1 point from the margin; "
                               "runs of the seeds you have are reused).")
    # an estimate past what seeds can practically give is said as such, with no --seeds to run
    row["depth"]["seeds_needed"] = 68
    assert "--seeds" not in last(undecided) and "~68 seeds" in last(undecided)
    # a run that failed the way a rerun repeats is never answered with "run the same command again"
    failed = store.json_safe(copy.deepcopy(undecided))
    failed["runs"][0].update(status="failed", message="ValueError: the rule's shapes do not match")
    assert "run the same command again" not in last(failed) and "a rerun repeats" in last(failed)
    failed["runs"][0].update(message="interrupted by the user")
    assert "run the same command again" in last(failed)


def _flat(text):
    """A text as compared for repetition: whitespace collapsed, every number masked."""
    return re.sub(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?", "#", " ".join(text.split()))


@pytest.mark.parametrize("columns", [80, 120])
def test_the_terminal_says_each_reason_once_defines_its_symbols_and_agrees_with_next(columns, monkeypatch):
    """The zoo audit (docs/rules/audit.json: 14 rules, reasons, weak controls, per-seed notes,
    undetermined (d)) at the width COLUMNS gives, as the command line reads it: each reason,
    missing item and note of a method is said once (a per-seed note once for all its seeds; a
    note inside a reason not again); every symbol a table cell uses is defined in the legend;
    the columns (d) rests on stay; `next:` suggests as many seeds as the estimate says, and none
    where the estimate is past what seeds can give."""
    import shutil
    from pathlib import Path
    from creditaudit.report import compact_table
    from creditaudit.report.tables import SEEDS_WORTH_ADDING
    monkeypatch.setenv("COLUMNS", str(columns))
    audit = json.loads((Path(__file__).resolve().parents[1] / "docs" / "rules" / "audit.json").read_text())
    text = compact_table(audit, width=shutil.get_terminal_size((120, 24)).columns, out="audits/zoo")
    lines = text.splitlines()
    assert max(map(len, lines)) <= columns
    top = next(i for i, line in enumerate(lines) if line.startswith("method "))
    assert "frozen %" in lines[top] and "vs yardstick" in lines[top]
    end = lines.index("", top)
    table, rest = "\n".join(lines[top + 2:end]), "\n".join(lines[end:])
    legend = " ".join(rest.strip().split("\n\n")[0].split())
    for symbol, defined in (("*", "*: "), ("—", "—: "), ("exact", "exact: "), ("λ=", "λ: "), ("±", "mean ± std"),
                            ("weak", "weak: ")):
        if symbol in table:
            assert defined in legend, symbol
    from creditaudit.report.format import _method_name
    sections = [" ".join(part.split()) for part in text.split("\n\n")]
    for row in audit["methods"]:
        mine = [p for p in sections if p.startswith(f"{_method_name(row)}: ")]
        assert len(mine) == 1, _method_name(row)
        flat = _flat(mine[0])
        for item in [*row["reasons"], *row["missing"], *row["notes"]]:
            body = re.sub(r"^\S+/s\d+: ", "", " ".join(item.split()))
            key = _flat(re.sub(r"^\([a-d]′?\) ", "", body).rstrip("."))[:90]
            assert flat.count(key) == 1, (row["method"], key, flat.count(key))
    step = " ".join(text.split("\n\n")[-1].split())
    from creditaudit.report.tables import seeds_needed
    estimates = [n for row in audit["methods"] for n in [seeds_needed(row)] if n is not None]
    assert estimates, "the zoo audit should hold an undetermined (d)"
    worth = [n for n in estimates if n <= SEEDS_WORTH_ADDING]
    suggested = re.search(r"--seeds ((?:\d+ )+)\(", step)
    assert (suggested is not None) == bool(worth)
    if worth:
        assert len(suggested.group(1).split()) == max(worth)
    for n in estimates:
        if n > SEEDS_WORTH_ADDING:
            assert f"~{n} seeds" in step
    assert "run the same command again" not in step       # every run finished


def test_a_failure_that_repeats_is_never_advised_a_rerun_and_seeds_are_counted(audited, tmp_path):
    """Through the command line (`creditaudit report` at COLUMNS=80): a run that failed the way a
    rerun repeats makes `next:` say to change its cause, not to run the command again."""
    import os
    import subprocess
    import sys
    result, _, tmp = audited
    audit = store.json_safe(copy.deepcopy(result))
    audit["runs"][0].update(status="failed", message="ValueError: the rule's shapes do not match")
    row = _row(audit, audit["runs"][0]["method"])
    incomplete = Verdict("project", "incomplete", missing=("1/2 runs failed",))
    row.update(verdict=incomplete.text, verdicts={"project": incomplete.to_dict(), "paper": incomplete.to_dict()})
    store.write_sealed_json(tmp_path / "audit.json", audit)
    env = {**os.environ, "COLUMNS": "80", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-m", "creditaudit", "report", str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    printed = done.stdout.split("\nwritten from")[0]
    assert max(map(len, printed.splitlines())) <= 80
    step = " ".join(printed.split("\n\n")[-1].split())
    assert step.startswith("next:") and "a rerun repeats" in step and "run the same command again" not in step


def test_a_figure_is_drawn_again_only_when_what_it_shows_changed(audited, tmp_path, monkeypatch):
    """What audit.json records about the command (wall time, runs trained now, diagnoses reused, the
    schedule) draws nothing: every figure of a re-run's audit is the same picture. A second report
    of the same audit takes the figures as they are (no figure maker called); one whose drawn
    content changed, or whose PNG lacks the key, draws again."""
    import creditaudit.report.figures as figures
    result, _, _ = audited
    audit = store.json_safe(result)
    rerun = copy.deepcopy(audit)
    rerun.update(created="another day", wall_time=1.5, runs_trained_now=0,
                 diagnoses_reused=len(rerun["runs"]))
    for run in rerun["runs"]:
        run.update(trained_now=not run["trained_now"], diagnosis_reused=True,
                   stack={"id": 99, "size": 1, "alone": "finished before, reused"})
    for name, make in figures.FIGURE_MAKERS.items():
        assert figures._png(make(rerun)) == figures._png(make(audit)), name     # they draw nothing
        assert figures.figure_key(rerun, name) == figures.figure_key(audit, name)
    drawn = []
    monkeypatch.setattr(figures, "FIGURE_MAKERS", {
        name: (lambda make, name: lambda a: (drawn.append(name), make(a))[1])(make, name)
        for name, make in figures.FIGURE_MAKERS.items()})
    first = write_report(audit, tmp_path)
    assert sorted(drawn) == sorted(figures.FIGURES)
    before = {name: first[name].read_bytes() for name in figures.FIGURES}
    drawn.clear()
    again = write_report(rerun, tmp_path)
    assert drawn == [] and {n: again[n].read_bytes() for n in figures.FIGURES} == before
    import base64
    html = (tmp_path / "report.html").read_text()
    assert all(base64.b64encode(png).decode() in html for png in before.values())   # kept and embedded
    changed = copy.deepcopy(rerun)
    changed["runs"][0]["test_acc"] = 0.123456
    write_report(changed, tmp_path)
    assert sorted(drawn) == sorted(figures.FIGURES)
    drawn.clear()
    (tmp_path / "gamma.png").write_bytes(figures._png(figures.FIGURE_MAKERS["gamma.png"](changed)))  # no key
    drawn.clear()
    write_report(changed, tmp_path)
    assert drawn == ["gamma.png"]


def test_figures_drawn_in_the_workers_are_the_driver_s_and_a_failed_one_is_drawn_again(audited, tmp_path):
    """The audit hands its idle local workers to the report (`write_report(executor=…)`): each
    figure to draw is one job there (`figures.draw_job`), only figures that changed are sent,
    the PNGs are byte for byte the driver's, and a figure a worker could not draw is drawn by
    the driver."""
    import creditaudit.report.figures as figures
    result, _, _ = audited
    audit = store.json_safe(result)

    class Workers:          # the executor protocol (runner/__init__.py), in this process
        def __init__(self, fail=()):
            self.jobs, self.fail = [], set(fail)

        def map(self, fn, jobs, on_done):
            self.jobs += [name for _, name, _ in jobs]
            records = [{"error": "worker died"} if name in self.fail else fn((a, name, key))
                       for a, name, key in jobs]
            for i, r in enumerate(records):
                on_done(i, r)
            return records

    alone = write_report(audit, tmp_path / "alone")
    workers = Workers(fail={"rho.png"})
    there = write_report(audit, tmp_path / "there", executor=workers)
    assert sorted(workers.jobs) == sorted(figures.FIGURES)
    assert {n: there[n].read_bytes() for n in figures.FIGURES} == {n: alone[n].read_bytes() for n in figures.FIGURES}
    assert figures.draw_job((audit, "no-such.png", "k"))["error"].startswith("KeyError")
    again = Workers()
    write_report(audit, tmp_path / "there", executor=again)
    assert again.jobs == []                       # nothing changed: nothing is sent
