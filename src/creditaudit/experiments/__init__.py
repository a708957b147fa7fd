"""Experiments that compose training, methods and the protocol; each owns its JSON.

    audit            every method × seed + its frozen and shallow controls → audit.json
    ladder           accuracy vs number of trainable blocks k = 0 … L → ladder.json
    penalty_sweep    a penalised method over λ, with frozen controls → penalty_sweep.json
    identity_check   the frozen-init identity check over seeds → identity_check.json
"""
from .audit import STRATEGIES, audit, frozen_control_of, read_audit, reporting_strategies, summarize_method
from .common import Execution, Outcome, eval_batches, run_all
from .identity import identity_check_experiment
from .ladder import ladder
from .penalty import penalty_sweep

__all__ = ["Execution", "Outcome", "STRATEGIES", "audit", "eval_batches", "frozen_control_of",
           "identity_check_experiment", "ladder", "penalty_sweep", "read_audit", "reporting_strategies",
           "run_all", "summarize_method"]
