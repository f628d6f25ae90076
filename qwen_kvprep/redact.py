"""Keep secrets out of every output.

The one place that redacts: every report (human, --json, --report), every error message
and fix hint, every log excerpt shown to the user (build and smoke logs) and prestart's
messages go through `scrub`. What never appears:
- the values of environment variables whose NAMES contain TOKEN, KEY, SECRET or PASSWORD
  (HF_TOKEN, AWS_SECRET_ACCESS_KEY, WANDB_API_KEY, ...), wherever they occur: in a path, a
  command line found in /proc, an error message;
- anything shaped like a Hugging Face token (`hf_` and 30+ letters/digits), whatever
  variable (if any) it came from;
- the user and password of a URL (`https://user:password@mirror/` is shown as
  `https://***@mirror/`), and the password of such a URL found in any environment variable
  (HF_ENDPOINT, HTTPS_PROXY...) wherever it appears alone;
- the credentials of an `Authorization` header (`Authorization: Bearer ...`, also in the
  dict repr an HTTP library puts in its errors) and of a bare `Bearer ...`.

Values shorter than 4 characters and plain booleans are not treated as secrets: redacting
"1" from every version number would make the output useless and protect nothing.

prestart's quick start imports this module to print its two lines: standard library only at
run time (`findings` is named for the types of `scrub_findings` alone), and cheap to import.
"""

from __future__ import annotations

import os
import re

TYPE_CHECKING = False
if TYPE_CHECKING:
    import logging
    from collections.abc import Iterable, Mapping
    from typing import Optional

    from qwen_kvprep.findings import Finding

_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD")
_PATTERNS = {
    "hf_token": r"hf_[A-Za-z0-9]{30,}",
    # scheme://userinfo@host: userinfo is what lies between "//" and "@" before any "/"
    "userinfo": r"(?i)\b([a-z][a-z0-9+.-]*://)([^\s/@?#]+)@",
    "auth_header": r"(?i)(\bauthorization\b['\"]?\s*[:=]\s*['\"]?)"
    r"((?:bearer|basic|token|digest)\s+)?[^\s'\",;}]+",
    "bearer": r"(?i)\b(bearer\s+)[A-Za-z0-9._~+/=-]{8,}",
}
# Compiled on first use: prestart's quick start prints through scrub and must stay cheap.
_COMPILED: dict[str, re.Pattern[str]] = {}


def _rx(name: str) -> re.Pattern[str]:
    rx = _COMPILED.get(name)
    if rx is None:
        rx = _COMPILED[name] = re.compile(_PATTERNS[name])
    return rx


def _sensitive(name: str) -> bool:
    upper = name.upper()
    return any(w in upper for w in _WORDS)


MASK = "***"
_MIN_SECRET_LEN = 4
_NOT_SECRET = {"true", "false", "yes", "no", "on", "off", "none", "null"}


def sensitive_names(environ: Optional[Mapping[str, str]] = None) -> list[str]:
    env = os.environ if environ is None else environ
    return sorted(n for n in env if _sensitive(n))


def _worth_masking(value: str) -> bool:
    return len(value.strip()) >= _MIN_SECRET_LEN and value.strip().lower() not in _NOT_SECRET


def secret_values(environ: Optional[Mapping[str, str]] = None) -> list[str]:
    """Values to mask, longest first (so a secret containing another is masked whole):
    those of sensitive variables, and the user:password of a URL in any variable."""
    env = os.environ if environ is None else environ
    values = {v for n, v in env.items() if _sensitive(n) and _worth_masking(v)}
    for value in env.values():
        if "://" not in value or "@" not in value:
            continue
        for m in _rx("userinfo").finditer(value):
            userinfo = m.group(2)
            from urllib.parse import unquote

            password = userinfo.partition(":")[2]
            for part in {userinfo, password, unquote(userinfo), unquote(password)}:
                if _worth_masking(part):
                    values.add(part)
    return sorted(values, key=len, reverse=True)


def scrub(text: str, environ: Optional[Mapping[str, str]] = None) -> str:
    """`text` with every secret replaced by ***."""
    if not text:
        return text
    if "://" in text and "@" in text:
        text = _rx("userinfo").sub(lambda m: f"{m.group(1)}{MASK}@", text)
    lower = text.lower()
    if "authorization" in lower:
        text = _rx("auth_header").sub(lambda m: f"{m.group(1)}{m.group(2) or ''}{MASK}", text)
    if "bearer" in lower:
        text = _rx("bearer").sub(lambda m: f"{m.group(1)}{MASK}", text)
    for value in secret_values(environ):
        text = text.replace(value, MASK)
    if "hf_" in text:
        text = _rx("hf_token").sub("hf_" + MASK, text)
    return text


def scrub_obj(obj: object, environ: Optional[Mapping[str, str]] = None) -> object:
    """Scrub every string inside dicts, lists and tuples (keys too)."""
    if isinstance(obj, str):
        return scrub(obj, environ)
    from collections.abc import Mapping

    if isinstance(obj, Mapping):
        return {scrub_obj(k, environ): scrub_obj(v, environ) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(scrub_obj(v, environ) for v in obj)
    return obj


def scrub_mapping(
    obj: Mapping[str, object], environ: Optional[Mapping[str, str]] = None
) -> dict[str, object]:
    """scrub_obj of a mapping with string keys, typed as one."""
    return {scrub(k, environ): scrub_obj(v, environ) for k, v in obj.items()}


def scrub_finding(f: Finding, environ: Optional[Mapping[str, str]] = None) -> Finding:
    from dataclasses import replace

    return replace(
        f,
        message=scrub(f.message, environ),
        fix=scrub(f.fix, environ) if f.fix is not None else None,
        paths=tuple(scrub(str(p), environ) for p in f.paths),
        details=scrub_mapping(f.details, environ),
    )


def scrub_findings(
    findings: Iterable[Finding], environ: Optional[Mapping[str, str]] = None
) -> list[Finding]:
    return [scrub_finding(f, environ) for f in findings]


# ---------------------------------------------------------------------------------------
# what libraries log


def _scrub_record(record: logging.LogRecord) -> bool:
    try:
        message = record.getMessage()
    except Exception:  # a record that cannot be formatted is the library's problem
        return True
    clean = scrub(message)
    if clean != message:
        record.msg, record.args = clean, ()
    return True


def install_log_filter() -> None:
    """Scrub what libraries log through `logging` (huggingface_hub's retry warnings print
    the request URL, HF_ENDPOINT's user and password included): a filter on every handler
    of the loggers qwen-kvprep's dependencies write to, and on logging's last resort."""
    import logging

    handlers = [logging.lastResort] if logging.lastResort is not None else []
    for name in ("", "huggingface_hub", "transformers", "urllib3", "filelock", "torch"):
        handlers.extend(logging.getLogger(name).handlers)
    for handler in handlers:
        if _scrub_record not in handler.filters:
            handler.addFilter(_scrub_record)
