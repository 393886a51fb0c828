"""Exit codes of the ``ftrain`` commands (workers, the node agent, the tools), one meaning each."""

OK = 0
FAILED = 1
"""The job failed (``ftrain agent``), or problems were found (``ftrain ckpt verify``, ``gc``)."""
USAGE = 2
"""Bad input: a config error, a bad option or id, a service that cannot be reached."""
CHECKPOINT = 3
"""A worker stopped on a checkpoint error: no committed step can be loaded, or commits keep failing
(the message says which and why)."""
STUCK = 4
"""A live worker that its round watchdog could not free from a round its agent had left (blocked
where no socket shutdown reaches, e.g. a rendezvous retrying a dead peer) ended itself; its agent
replaces it like any failed worker."""
DRAINED = 75
"""``ftrain agent`` drained on SIGTERM (its workers finished a step and saved) before the job
ended: start it again to go on (sysexits' EX_TEMPFAIL). A Kubernetes failure policy or a
scheduler's requeue tells this from the job's end (``OK``) and from its failure (``FAILED``)."""
