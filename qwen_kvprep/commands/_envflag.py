"""A yes/no option that may come from its environment variable."""

from __future__ import annotations

from typing import Optional

import click
from click.core import ParameterSource

from qwen_kvprep.errors import UsageError


class EnvFlag(click.types.BoolParamType):
    """A flag that may come from its environment variable (prestart's, in images): a value
    there that is not a boolean is refused naming the variable, which click would not (it
    names the option, which nobody gave)."""

    def convert(
        self, value: object, param: Optional[click.Parameter], ctx: Optional[click.Context]
    ) -> bool:
        try:
            return bool(super().convert(value, param, ctx))
        except click.BadParameter:
            envvar = param.envvar if param is not None and isinstance(param.envvar, str) else None
            source = ctx.get_parameter_source(param.name or "") if ctx and param else None
            if envvar and source == ParameterSource.ENVIRONMENT:
                raise UsageError(
                    f"{envvar}={value!r} is not true or false",
                    fix=f"export {envvar}=1 (or 0; true/false, yes/no and on/off are read too)",
                ) from None
            raise
