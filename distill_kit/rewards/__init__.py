"""Verifiable rewards, like the losses: functions found by name, or given as ``package.module:function``.

A reward scores one sample of one prompt::

    def reward(prompt: str, completion: str) -> float: ...                      # the text only
    def reward(prompt: str, completion: str, *, completion_ids, answer) -> float: ...   # ids, a record's field

The first two parameters are the prompt and the sample as text (the tokenizer's decoding, special tokens left
out). Any further parameter is asked for by name: ``prompt_ids`` / ``completion_ids`` (lists of token ids), or a
field of the data record the prompt came from (``answer`` above; ``**fields`` takes them all). What the data lacks
is refused when the run starts. It returns a number (a bool counts as 0 or 1); anything else, or NaN, stops the
run with the prompt named (``distill_kit/training/rewarding.py``). A reward knows nothing of training: it runs on
the run's main process, on text, and what it returns is checked, never executed.

The project's task checkers are rewards out of the box: ``arithmetic`` and ``sorting`` (1 for a right answer, 0
otherwise). Your own: ``register("name")`` on the function, or its import path in the run config::

    training:
      rewards:
        functions: [{name: arithmetic, weight: 1.0}, {name: mypkg.rewards:format_ok, weight: 0.1}]
"""

from distill_kit.rewards.registry import REWARDS, RewardFunction, register, resolve

__all__ = ["REWARDS", "RewardFunction", "register", "resolve"]
