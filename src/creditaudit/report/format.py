"""Numbers and cells as a reader sees them: one formatter per kind of quantity, all reading either
form of a result dict (floats with NaN/inf, or JSON with null/"inf"); a missing value is "—"."""
from __future__ import annotations

import math
from typing import Any, Sequence

def _f(value: Any) -> float | None:
    """A number from either form of the audit dict; None for missing or NaN ("not measured")."""
    if value is None or isinstance(value, bool):
        return None
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(x) else x


def _plottable(value: Any, log: bool = False) -> float:
    """NaN for what a curve must skip (missing, non-finite, ≤ 0 on a log axis)."""
    x = _f(value)
    if x is None or not math.isfinite(x) or (log and x <= 0):
        return math.nan
    return x


def _sci(value: Any) -> str:
    """Norms and gains: 4.0e+08."""
    x = _f(value)
    return "—" if x is None else ("inf" if x == math.inf else "-inf" if x == -math.inf else f"{x:.1e}")


def _g(value: Any) -> str:
    """Ratios (max growth): 3 significant digits, scientific outside [0.001, 1e4)."""
    x = _f(value)
    if x is None:
        return "—"
    if not math.isfinite(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.3g}" if x == 0 or 1e-3 <= abs(x) < 1e4 else f"{x:.1e}"


def _signed(value: Any, digits: int = 3) -> str:
    """Cosines and correlations: +0.057."""
    x = _f(value)
    if x is None:
        return "—"
    if not math.isfinite(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:+.{digits}f}"


def _pct(mean: Any, std: Any = None) -> str:
    """Accuracy fraction → "87.8 ± 0.8" (percent)."""
    m, s = _f(mean), _f(std)
    if m is None:
        return "—"
    return f"{100 * m:.1f}" + ("" if s is None else f" ± {100 * s:.1f}")


def _method_name(row: dict) -> str:
    """A method as every table names it: its `name` (a user's rule too: `rule_name`, not its
    import path, which audit.md lists once), with λ where it has one."""
    lam = _f(row.get("lam"))
    name = str(row.get("rule_name") or row.get("method") or "?")
    return f"{name} (λ={lam:g})" if lam else name


def _first_fire(first: dict | None) -> str:
    """Per-seed first-fire epochs: "a: 8/9/11; a′: 4/4/5; b′: 3/4/4" (flags that never fired are left out)."""
    if not isinstance(first, dict):
        return "—"
    parts = []
    for key, short in (("a", "a"), ("a_prime", "a′"), ("b", "b"), ("b_prime", "b′")):
        epochs = first.get(key) or []
        if any(e is not None for e in epochs):
            parts.append(f"{short}: " + "/".join("—" if e is None else str(e) for e in epochs))
    return "; ".join(parts) or "never"


def _gamma_cells(row: dict) -> tuple[str, str]:
    """(deep Γ, its null with z). "*" marks Γ uninterpretable ((b) or (b′) fired); such a Γ gets
    no z ("z n/a"): a distance from the null means nothing against a reference with no signal."""
    if row.get("gamma_deep_exact"):       # every deep position exact: Γ = 1 there says nothing
        return "n/a (exact by construction)", "—"
    gamma = _f(row.get("gamma_deep"))
    if gamma is None:
        return "—", "—"
    uninterpretable = row.get("gamma_interpretable") is False
    mark = "*" if uninterpretable else ""
    mean, std = _f(row.get("null_deep_mean")), _f(row.get("null_deep_std"))
    if mean is None:
        return _signed(gamma) + mark, "—"
    null = f"{_signed(mean)} ± {'—' if std is None else f'{std:.3f}'}"
    if uninterpretable:
        null += " (z n/a*)"
    elif _f(row.get("gamma_deep_z")) is not None:
        null += f" (z {_f(row['gamma_deep_z']):+.1f})"
    elif "gamma_deep_z" not in row and std is not None and std > 0:    # an audit.json before it was stored
        null += f" (z {(gamma - mean) / std:+.1f})"
    return _signed(gamma) + mark, null




def _markdown(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table padded to fixed width, so it reads as plain text too."""
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|",
                      *(line(r) for r in rows)])


def _recipe(row: dict, key: str) -> str:
    """One field of a method row's recipe (audit.json: "label", "description", "citation",
    "source"); "—" for an audit written before recipes were recorded."""
    recipe = row.get("recipe")
    return str(recipe.get(key) or "—") if isinstance(recipe, dict) else "—"
