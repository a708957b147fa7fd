"""CA105: `torch.load(..., weights_only=False)`, which runs code from the file.

A mixin of `checker.Checker`: its methods read the checker's state (`facts`, scopes, `_report`).
The rule in full is in the package's docstring (`creditaudit.lint`)."""
from __future__ import annotations

import ast

from .syntax import _keyword


class LoadingCheck:
    """CA105: the methods `Checker` calls at each node."""

    # -- CA105

    def _check_torch_load(self, node: ast.Call) -> None:
        if self._name(node.func) != "torch.load":
            return
        flag = _keyword(node, "weights_only")
        if isinstance(flag, ast.Constant) and flag.value is False:
            self._report(node, "CA105",
                         "torch.load(..., weights_only=False) unpickles the file, which runs "
                         "arbitrary code from whoever wrote the checkpoint",
                         "use torch.load(path, weights_only=True), or store tensors with "
                         "safetensors (safetensors.torch.save_file / load_file)")
