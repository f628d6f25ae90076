"""JSON as `json.loads` returns it, for annotations: what a file we read holds before its
schema is checked, and what our JSON documents hold."""

from __future__ import annotations

from typing import Union

JSON = Union[None, bool, int, float, str, list["JSON"], dict[str, "JSON"]]
JSONObject = dict[str, JSON]


def as_json_object(value: object) -> JSONObject:
    """`value` as a JSON object, checked: a TypedDict of JSON values passes unchanged, and
    anything json.dumps would not write as it is (a tuple, a Path, a float key) is a
    TypeError here, not a surprise in a file read back later."""
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise TypeError(f"not a JSON object: {type(value).__name__}")
    for item in value.values():
        _check(item)
    return value


def _check(value: object) -> None:
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, list):
        for item in value:
            _check(item)
        return
    as_json_object(value)
