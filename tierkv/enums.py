"""The one enum style of tierkv, on every Python the package supports (3.10 and newer).

Two kinds of enum, and only these two:

* a :class:`StrEnum` for members that *are words*: config spellings (``persist``, ``verify``, ``locality``),
  stat and metric labels (``MissReason``).  A member is a ``str`` equal to its value, and ``str()``,
  ``format()`` / f-strings, ``%s`` and ``json.dumps`` all give the value, so a member can go wherever the
  word went;
* a plain ``enum.Enum`` for answers compared by identity (``PutOutcome``, ``Admission``): their values are
  only what ``.value`` prints, and a member is never equal to a string.

``enum.StrEnum`` exists from Python 3.11 on, and ``class X(str, enum.Enum)`` formats differently from one
Python to the next (3.12 changed ``format()`` of such mixins to the ``Class.MEMBER`` form), so this module
defines the class once and every string enum derives from it: the same behaviour on 3.10 through 3.13.
"""

from __future__ import annotations

import enum
from typing import Any


class StrEnum(str, enum.Enum):
    """An enum whose members are strings equal to their values, and print as them (3.11's ``enum.StrEnum``)."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, format_spec: str) -> str:
        return str.__format__(str.__str__(self), format_spec)

    @staticmethod
    def _generate_next_value_(name: str, start: int, count: int, last_values: list[Any]) -> str:
        # enum.auto() gives the member's name in lower case, as enum.StrEnum does
        return name.lower()
