"""What each subcommand does once `cli.py` has parsed it: one `cmd_<name>(args) -> int` per command.

    train.py        train
    diagnose.py     diagnose, calibrate, check
    audit.py        audit (and the settings ladder and penalty-sweep share with it)
    experiments.py  ladder, penalty-sweep, identity-check
    views.py        thresholds, report
    lint.py         lint
    running.py      how a command runs: threads, its folder's lock, a failed run recorded, the report
                    written whole
    exits.py        exit statuses, and what to say of failed runs
"""
