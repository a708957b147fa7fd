"""The one exception type for errors a user can cause and fix.

Missing data, a bad config key, an unknown method, a corrupt or foreign checkpoint: each raises
`CreditAuditError` with a message that names the problem and the fix. The command line prints the
message on one line and exits non-zero, without a traceback. Anything else is a bug and keeps its
traceback.
"""


class CreditAuditError(Exception):
    """A user-fixable problem; the message says what is wrong and what to do."""


class CreditAuditWarning(UserWarning):
    """Something the user should see but that does not stop the program (e.g. a monitor flag
    that fired during training); filter it with the `warnings` module like any other warning."""
