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


class TeacherUnavailable(RuntimeError):
    """A teacher outside the training processes (a server) stopped answering for longer than the run waits. The loop
    stops cleanly on it (a checkpoint of the last whole step, then an exit) and ``--resume`` continues once it is
    back; the message names the teacher and how long it was waited for."""


class RewardFailed(RuntimeError):
    """A reward raised, or returned something other than a finite number, on a sample mid-run. The loop stops as for
    an unavailable teacher (a checkpoint of the last whole step, a non-zero exit) and ``--resume`` continues once the
    reward is fixed; the message names the reward, the prompt and what it returned."""
