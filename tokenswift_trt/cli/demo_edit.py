"""`demo`'s editing request: a document to revise, whose answer copies much of its input (the job
where long matches commit many tokens per verify). The request ships here, so the demo needs no file
outside the package."""

from __future__ import annotations

from pathlib import Path

EDIT_TOKENS = 1024  # the answer's limit; it normally ends at EOS well before

EDIT_REQUEST = '''Add a docstring to the function `clamp` in this Python code. Reply with the whole code.

```python
import math


def clamp(value, low, high):
    if value < low:
        return low
    if value > high:
        return high
    return value


def lerp(start, end, fraction):
    """The point `fraction` of the way from `start` to `end`."""
    return start + (end - start) * fraction


def distance(first, second):
    """The Euclidean distance between two points given as (x, y) pairs."""
    dx = second[0] - first[0]
    dy = second[1] - first[1]
    return math.sqrt(dx * dx + dy * dy)


def angle(first, second):
    """The angle in radians of the line from `first` to `second`."""
    dx = second[0] - first[0]
    dy = second[1] - first[1]
    return math.atan2(dy, dx)
```
'''


def edit_prompt(directory: Path) -> tuple[str, bool]:
    """The request as the model's chat template writes a user turn, and True; a model without a
    chat template gets the request as plain text, and False."""
    from tokenswift_trt.serving.openai_api import ServedModel

    served = ServedModel.from_dir(directory)
    if served.chat_template is None:
        return EDIT_REQUEST, False
    return served.chat_prompt([{"role": "user", "content": EDIT_REQUEST}]), True
