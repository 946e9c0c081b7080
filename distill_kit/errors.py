"""The errors a user can cause, on the ground floor: every layer raises them, none imports upward for them.

Each is a ``ValueError`` whose message names what is wrong and the fix; the CLI prints it on one line, without a
traceback (``run/cli.py``).
"""


class ConfigError(ValueError):
    """A run config that cannot run; the message names the key, the value and the fix."""


class DataError(ValueError):
    """A data file that cannot become training text; the message names the file (and line or record) and the fix."""


class DeepSpeedConfigError(ValueError):
    """A DeepSpeed config that cannot drive an engine; the message lists every problem and its fix."""


class CheckpointError(OSError):
    """A checkpoint that could not be written; the message names the folder, the cause, the free space and the fix."""


class StepFault(RuntimeError):
    """Something outside the students failed mid-run in a way the run cannot step past: a teacher server
    (:class:`TeacherFault`), a reward (:class:`RewardFailed`). The loop stops cleanly on it (a checkpoint of the last
    whole step, the unfinished step rewound, ``stopped_by`` naming it) and the CLI exits with a non-zero status, its
    message on one line after ``label``; ``--resume`` continues once it is fixed."""

    what = "a failure outside the students"
    """How ``stopped_by`` names the stop."""
    label = "error"
    """What the CLI's one line starts with."""


class TeacherFault(StepFault):
    """A teacher outside the training processes (a server) failed mid-run."""

    what = "the teacher failing"
    label = "teacher error"


class TeacherUnavailable(TeacherFault):
    """A teacher server that stopped answering for longer than the run waits (``retries_s``, or one request past
    ``timeout_s``); the message names the teacher and how long it was waited for."""

    what = "the teacher being unavailable"


class TeacherResponseError(TeacherFault, ValueError):
    """A teacher server's answer that cannot be trained on (not JSON, cut off, too large, another shape, a value out
    of range); the message names the server, the field and what to do. Never retried: a server that answers wrongly
    once will again."""

    what = "an answer of the teacher that cannot be trained on"


class RewardFailed(StepFault):
    """A reward raised, or returned something other than a finite number, on a sample mid-run; the message names the
    reward, the prompt and what it returned."""

    what = "a reward failing"
    label = "reward error"
