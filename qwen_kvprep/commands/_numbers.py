"""Number types for options: a range check that nan and inf cannot slip through."""

from __future__ import annotations

import math
from typing import Any, Optional

import click


class FiniteFloatRange(click.FloatRange):
    """click.FloatRange that refuses nan and inf: nan passes every comparison of a range,
    and inf would read as "no limit", which no number option of ours means."""

    def convert(  # Any: click's own signature, which differs between its releases
        self, value: Any, param: Optional[click.Parameter], ctx: Optional[click.Context]
    ) -> Any:
        number = super().convert(value, param, ctx)
        if isinstance(number, float) and not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number
