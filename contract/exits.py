"""Exit codes of the ``ftrain`` commands (workers, the node agent, the tools), one meaning each."""

OK = 0
FAILED = 1
"""The job failed (``ftrain agent``), or problems were found (``ftrain ckpt verify``, ``gc``)."""
USAGE = 2
"""Bad input: a config error, a bad option or id, a service that cannot be reached."""
CHECKPOINT = 3
"""A worker stopped on a checkpoint error: no committed step can be loaded, or commits keep failing
(the message says which and why)."""
