"""Storage options: checked once, where they enter, with messages that say what to write.

``storage_options`` is a mapping of option name to value. Values are strings, as Spark and the
command line hand them over; an ``int`` or a ``bool`` is also accepted and taken in its string
form (``30`` as ``"30"``, ``True`` as ``"true"``), which is what obstore parses. Anything else
(a float outside the timeouts, ``None``, bytes, a nested mapping) is refused, naming the option.

HTTP client options are checked here because obstore's own errors do not name them:

* timeouts (``timeout``, ``connect_timeout``, ...): a number of seconds (``30``, ``2.5``,
  ``"30"``) or numbers with units (``"30s"``, ``"500ms"``, ``"2min"``, ``"1h 30min"``), > 0;
* switches (``allow_http``, ...): ``true``/``false`` (case and spaces ignored) or a bool;
* ``pool_max_idle_per_host``: an int >= 0;
* URLs (``endpoint``, ``proxy_url``, ``base_url``, ``authority_host``, ``metadata_endpoint``,
  ``msi_endpoint``, with or without the store's alias prefix): an http:// or https:// URL with
  a host. obstore takes most malformed ones and fails only at the first request.

Other store config keys (``region``, credentials, ...) are left to obstore, which knows every
alias (``aws_access_key_id``, ``AZURE_STORAGE_ACCOUNT_KEY``, ...); when it refuses a name,
:func:`unknown_option_message` lists the names the store takes, and when it refuses a value
without naming its option (it never does), :func:`unparsable_option_message` finds the option
by its value. No message here shows the value
of an option whose name marks it as a secret.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

__all__ = [
    "SECRET_MARKERS",
    "check_plain_http",
    "check_storage_options",
    "is_secret_option",
    "split_client_options",
    "unknown_option_message",
    "unparsable_option_message",
    "url_password",
]

# Option names whose values are secrets: never shown, and scrubbed from every message.
SECRET_MARKERS = (
    "secret",
    "token",
    "password",
    "access_key",
    "account_key",
    "sas_",
    "service_account_key",
    "customer_key",
    "private_key",
    "encryption_key",
)

# obstore's ClientConfig keys (HTTP client options), by the form of their value.
# default_headers is left out: it is a mapping, which a flat string option cannot carry.
_DURATION_OPTIONS = frozenset(
    {
        "connect_timeout",
        "http2_keep_alive_interval",
        "http2_keep_alive_timeout",
        "pool_idle_timeout",
        "read_timeout",
        "timeout",
    }
)
_BOOL_OPTIONS = frozenset(
    {
        "allow_http",
        "allow_invalid_certificates",
        "http1_only",
        "http2_keep_alive_while_idle",
        "http2_only",
        "randomize_addresses",
    }
)
_COUNT_OPTIONS = frozenset({"pool_max_idle_per_host"})
_TEXT_OPTIONS = frozenset(
    {
        "default_content_type",
        "proxy_ca_certificate",
        "proxy_excludes",
        "proxy_url",
        "root_certificate",
        "user_agent",
    }
)
CLIENT_OPTIONS = _DURATION_OPTIONS | _BOOL_OPTIONS | _COUNT_OPTIONS | _TEXT_OPTIONS

# Config keys of each store as obstore 0.12 documents them (S3Config, GCSConfig, AzureConfig),
# less sts_endpoint, which its stubs list and 0.12.1 refuses. Only for messages: obstore decides
# what it accepts (tests/storage/test_options.py checks it still takes every name listed here).
STORE_KEYS: dict[str, tuple[str, frozenset[str]]] = {
    "s3": (
        "S3",
        frozenset(
            {
                "access_key_id",
                "bucket",
                "checksum_algorithm",
                "conditional_put",
                "container_authorization_token_file",
                "container_credentials_full_uri",
                "container_credentials_relative_uri",
                "copy_if_not_exists",
                "default_region",
                "disable_bulk_delete",
                "disable_tagging",
                "endpoint",
                "metadata_endpoint",
                "region",
                "request_payer",
                "role_arn",
                "role_session_name",
                "secret_access_key",
                "server_side_encryption",
                "session_token",
                "skip_signature",
                "sse_bucket_key_enabled",
                "sse_kms_key_id",
                "unsigned_payload",
                "virtual_hosted_style_request",
                "web_identity_token_file",
            }
        ),
    ),
    "gs": (
        "GCS",
        frozenset(
            {
                "application_credentials",
                "base_url",
                "bearer_token",
                "bucket",
                "service_account",
                "service_account_key",
                "skip_signature",
            }
        ),
    ),
    "az": (
        "Azure",
        frozenset(
            {
                "account_key",
                "account_name",
                "authority_host",
                "client_id",
                "client_secret",
                "container_name",
                "credential_type",
                "disable_tagging",
                "encryption_key",
                "endpoint",
                "fabric_cluster_identifier",
                "fabric_session_token",
                "fabric_token_service_url",
                "fabric_workload_host",
                "federated_token_file",
                "msi_endpoint",
                "msi_resource_id",
                "object_id",
                "sas_key",
                "skip_signature",
                "tenant_id",
                "token",
                "use_azure_cli",
                "use_emulator",
                "use_fabric_endpoint",
            }
        ),
    ),
}
_STORE_OF_SCHEME = {"s3": "s3", "s3a": "s3", "gs": "gs", "az": "az", "abfs": "az", "abfss": "az"}
_ALIAS_PREFIX = {"s3": "aws_", "gs": "google_", "az": "azure_"}

_DURATION_FORM = (
    "a duration > 0: a number of seconds (30, 2.5, '30') or numbers with units "
    "('30s', '500ms', '2min', '1h 30min')"
)
# humantime's units, case-sensitive as there ("M" is a month there; months are refused here).
_SPAN = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zµ]+)\s*")
_UNIT_SECONDS = {
    **dict.fromkeys(("ns", "nsec"), 1e-9),
    **dict.fromkeys(("us", "µs", "usec"), 1e-6),
    **dict.fromkeys(("ms", "msec"), 1e-3),
    **dict.fromkeys(("s", "sec", "secs", "second", "seconds"), 1.0),
    **dict.fromkeys(("m", "min", "mins", "minute", "minutes"), 60.0),
    **dict.fromkeys(("h", "hr", "hrs", "hour", "hours"), 3600.0),
    **dict.fromkeys(("d", "day", "days"), 86400.0),
}
_MAX_SHOWN = 60
# How obstore says a config value does not parse: it names the value and the form, never the
# key, in one of these phrasings (obstore 0.12).
_UNPARSABLE = (
    re.compile(r'failed to parse "(?P<value>[^"]*)" as (?P<form>[\w ]+)', re.IGNORECASE),
    re.compile(r'"(?P<value>[^"]*)" is not a valid (?P<form>[\w ]+)'),
    re.compile(r"invalid (?P<form>[\w ]+?): (?P<value>[^\s]+?)\.\s*(?P<valid>valid values[^\n]*)?",
               re.IGNORECASE),
)  # fmt: skip
_FORM_HINTS = {
    "boolean": "'true' or 'false'",
    "S3PutConditional": "'etag' or 'disabled'",
    "S3CopyIfNotExists": "'multipart', 'header:<name>:<value>' or "
    "'header-with-status:<name>:<value>:<status>'",
    "checksum algorithm": "'sha256'",
}
# Options whose value is a URL, by name without the store's alias prefix ("aws_", ...). obstore
# takes most malformed ones and fails only at the first request, naming neither.
_URL_OPTIONS = frozenset(
    {
        "authority_host",
        "base_url",
        "endpoint",
        "endpoint_url",
        "metadata_endpoint",
        "msi_endpoint",
        "proxy_url",
    }
)
_URL_FORM = "an http:// or https:// URL with a host, e.g. 'http://127.0.0.1:9000'"


def is_secret_option(name: str) -> bool:
    """True if the option ``name`` holds a secret (a key, token, password, ...)."""
    lowered = name.lower()
    return any(marker in lowered for marker in SECRET_MARKERS)


def check_storage_options(options: object) -> dict[str, str]:
    """Validate ``storage_options`` and return them as a ``dict`` of str names to str values.

    ``None`` is no options. Ints and bools become their string form (``True`` as ``"true"``).

    Raises:
        ValueError: ``options`` is not a mapping, a name is not a non-empty str, or a value
            is neither a str, an int nor a bool. The message names the option and the
            value's type, and shows the value unless the option holds a secret.
    """
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        # A str value may be a whole "key=secret" line: say what it is, not what it holds.
        raise ValueError(
            "storage_options must be a mapping of option name to value, e.g. "
            "{'endpoint': 'http://127.0.0.1:9000', 'allow_http': 'true'}; "
            f"got a {type(options).__name__}"
        )
    checked: dict[str, str] = {}
    for name, value in options.items():
        if not isinstance(name, str) or not name.strip():
            raise ValueError(
                f"storage option names must be non-empty str; got {type(name).__name__} "
                f"{_shown_name(name)}"
            )
        text = _as_text(name, value)
        _parse_client_option(name, text, value)  # Refuse a bad client value here, once.
        _check_url(name, text, value)
        checked[name] = text
    return checked


def check_plain_http(options: Mapping[str, str]) -> None:
    """Refuse an ``http://`` endpoint without ``allow_http``: the client refuses it too, but
    only as "builder error" at the first request.

    Raises:
        ValueError: an endpoint option is an http URL and ``allow_http`` is not true.
    """
    allowed = {_bare(n): v for n, v in options.items()}.get("allow_http", "false")
    if allowed.strip().lower() == "true":
        return
    for name, value in options.items():
        if _bare(name) in ("endpoint", "endpoint_url") and value.strip().lower().startswith(
            "http://"
        ):
            raise ValueError(
                f"storage option {name!r} is a plain http:// URL, which the client refuses "
                "unless storage option 'allow_http' is 'true': add it (a local emulator), or "
                "use https://"
            )


def _bare(name: str) -> str:
    """An option name without its backend's alias prefix (``aws_endpoint``: ``endpoint``)."""
    key = name.lower()
    for prefix in _ALIAS_PREFIX.values():
        key = key.removeprefix(prefix)
    return key


def split_client_options(options: Mapping[str, str]) -> tuple[dict[str, str], dict[str, Any]]:
    """Split checked options into obstore store config and HTTP client options.

    Client option values are parsed into what obstore takes (a bool for a switch, a duration
    string it reads exactly); store config values pass through for obstore to check.

    Raises:
        ValueError: a client option's value is not of its form; the message names the
            option, the form expected and the value found.
    """
    config: dict[str, str] = {}
    client: dict[str, Any] = {}
    for name, value in options.items():
        parsed = _parse_client_option(name, value, value)
        if parsed is None:
            config[name] = value
        else:
            client[name.lower()] = parsed
    return config, client


def unknown_option_message(name: str, scheme: str, uri: str) -> str:
    """What to say when obstore does not know the option ``name`` for a store of ``scheme``."""
    store = _STORE_OF_SCHEME.get(scheme, scheme)
    label, keys = STORE_KEYS.get(store, (scheme, frozenset()))
    prefix = _ALIAS_PREFIX.get(store, "")
    close = difflib.get_close_matches(name.lower().removeprefix(prefix), keys | CLIENT_OPTIONS, 1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (
        f"unknown storage option {name!r} for {uri}{hint}. {label} takes: "
        f"{', '.join(sorted(keys))} (also with the {prefix!r} prefix, in any case); "
        f"HTTP client options: {', '.join(sorted(CLIENT_OPTIONS))}"
    )


def unparsable_option_message(message: str, options: Mapping[str, str]) -> str | None:
    """Name the option behind obstore's "failed to parse" ``message``; ``None`` if unsure.

    obstore names the value it could not parse but not the option, so the option is found
    by its value (all of them, if several options hold that value).
    """
    found = next((m for p in _UNPARSABLE if (m := p.search(message)) is not None), None)
    if found is None:
        return None
    names = sorted(name for name, value in options.items() if value == found["value"])
    if not names:
        return None
    form = found["form"].strip()
    valid = found.groupdict().get("valid")
    hint = f" ({_FORM_HINTS[form]})" if form in _FORM_HINTS else ""
    hint = f" ({valid.strip()})" if valid else hint
    which = " or ".join(repr(name) for name in names)
    secret = next((name for name in names if is_secret_option(name)), names[0])
    return f"storage option {which} must be a {form}{hint}; got {_found(secret, found['value'])}"


def _check_url(name: str, text: str, original: object) -> None:
    """Refuse a URL option (``endpoint``, ``proxy_url``, ...) that is no http(s) URL."""
    if _bare(name) not in _URL_OPTIONS:
        return
    try:
        parts = urlsplit(text.strip())
        ok = parts.scheme.lower() in ("http", "https") and bool(parts.hostname)
    except ValueError:  # a malformed port or IPv6 address
        ok = False
    if not ok:
        raise ValueError(
            f"storage option {name!r} must be {_URL_FORM}; got {_found(name, original)}"
        )


def _as_text(name: str, value: object) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float) and name.lower() in _DURATION_OPTIONS:
        return repr(value)  # Seconds; the duration check refuses nan, inf and <= 0.
    raise ValueError(
        f"storage option {name!r} must be a str (an int or a bool is taken as its string "
        f"form); got {_found(name, value)}"
    )


def _parse_client_option(name: str, text: str, original: object) -> bool | str | None:
    """The value obstore takes for client option ``name``; ``None`` if it is a config key.

    ``original`` is what the caller gave, shown in the error.
    """
    key = name.lower()
    if key in _BOOL_OPTIONS:
        return _parse_bool(name, text, original)
    if key in _DURATION_OPTIONS:
        return _parse_duration(name, text, original)
    if key in _COUNT_OPTIONS:
        return _parse_count(name, text, original)
    if key in _TEXT_OPTIONS:
        return text
    return None


def _parse_bool(name: str, text: str, original: object) -> bool:
    # A number is no switch: 1 and 0 are refused rather than guessed.
    word = text.strip().lower()
    if word not in ("true", "false") or not isinstance(original, str | bool):
        raise ValueError(
            f"storage option {name!r} must be 'true' or 'false' (or a bool); "
            f"got {_found(name, original)}"
        )
    return word == "true"


def _parse_count(name: str, text: str, original: object) -> str:
    digits = text.strip()
    if not digits.isdigit() or isinstance(original, bool):
        raise ValueError(
            f"storage option {name!r} must be an int >= 0; got {_found(name, original)}"
        )
    return str(int(digits))


def _parse_duration(name: str, text: str, original: object) -> str:
    """A duration in obstore's (humantime's) syntax, in whole microseconds."""
    spelled = text.strip()
    seconds: float | None = None
    if isinstance(original, bool):
        seconds = None
    elif _is_float(spelled):
        seconds = float(spelled)
    elif spelled:
        seconds = _sum_spans(spelled)
    if seconds is None or not math.isfinite(seconds) or round(seconds * 1e6) < 1:
        raise ValueError(
            f"storage option {name!r} must be {_DURATION_FORM}; got {_found(name, original)}"
        )
    return f"{round(seconds * 1e6)}us"


def _sum_spans(text: str) -> float | None:
    total = 0.0
    position = 0
    while position < len(text):
        span = _SPAN.match(text, position)
        if span is None or span.group(2) not in _UNIT_SECONDS:
            return None
        total += float(span.group(1)) * _UNIT_SECONDS[span.group(2)]
        position = span.end()
    return total


def _is_float(text: str) -> bool:
    # Floats in Python's own spelling ("2.5", "1e3"), as repr() writes them.
    try:
        float(text)
    except ValueError:
        return False
    return not text.lower().lstrip("+-").startswith(("inf", "nan"))


def _found(name: str, value: object) -> str:
    """``<type> <value>`` for a message; the value is hidden if the option holds a secret,
    or looks like a URL with a password (an endpoint or a proxy with user:password@)."""
    if is_secret_option(name) or (isinstance(value, str) and url_password(value) is not None):
        return f"{type(value).__name__} (value hidden: it is a secret)"
    text = repr(value)
    shown = text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."
    return f"{type(value).__name__} {shown}"


def url_password(text: str) -> str | None:
    """The password of a URL option value (``user:password@host``); ``None`` if it has
    none, ``""`` if it is too malformed to tell (it may still hold one)."""
    if "@" not in text:
        return None
    try:
        return urlsplit(text.strip()).password
    except ValueError:
        return ""


def _shown_name(name: object) -> str:
    text = repr(name)
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."
