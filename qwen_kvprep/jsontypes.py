"""JSON as `json.loads` returns it, for annotations: what a file we read holds before its
schema is checked, and what our JSON documents hold."""

from __future__ import annotations

from typing import Union

JSON = Union[None, bool, int, float, str, list["JSON"], dict[str, "JSON"]]
JSONObject = dict[str, JSON]
