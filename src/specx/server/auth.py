"""Who may call the server: API keys, sent as OpenAI's `Authorization: Bearer KEY`.

With keys configured every route answers 401 with OpenAI's error object unless the request
carries one of them or the route's `Guard` (in the route table, `specx.server.routes`) lets
it in without: /health always, /metrics when the operator opens it. Keys are
compared in constant time over their SHA-256 digests (neither the key's length nor how
much of it matched shows in the timing) and never appear in a message or a log line.
Without keys the server is open, which `check_bind` allows on loopback addresses only
unless the operator says so by name (`insecure_no_key`).

Keys come from `--api-key` (repeatable), `--api-key-file` (one per line; blank lines and
`#` comments skipped) and the SPECX_API_KEY environment variable (comma-separated), all
together (`collect_keys`).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from specx.errors import SpecxError
from specx.server.protocol import ApiError

__all__ = ["ENV_VAR", "Access", "Guard", "check_bind", "collect_keys"]

ENV_VAR = "SPECX_API_KEY"


class Guard(Enum):
    """Which requests a route lets in when the server has keys (without keys: all)."""

    KEY = "key"  # those that carry a key
    OPEN = "open"  # all: load balancers' health probes carry no key
    METRICS = "metrics"  # those with a key, or all if the operator opened /metrics


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class Access:
    """The keys a request may present (none: open) and which paths need none."""

    keys: tuple[str, ...] = ()
    open_metrics: bool = False  # /metrics without a key
    _digests: tuple[bytes, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_digests", tuple(_digest(k) for k in self.keys))

    def __repr__(self) -> str:  # never the keys themselves
        return f"Access({len(self.keys)} keys, open_metrics={self.open_metrics})"

    @property
    def required(self) -> bool:
        """True when requests must present a key."""
        return bool(self.keys)

    def check(self, guard: Guard, authorization: str | None) -> None:
        """Raises ApiError 401 unless `guard` lets anyone in or `authorization` carries a key."""
        if not self.keys or guard is Guard.OPEN or (self.open_metrics and guard is Guard.METRICS):
            return
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise ApiError(
                401,
                "no API key: send it as the header 'Authorization: Bearer YOUR_KEY'",
                kind="invalid_request_error",
                code="invalid_api_key",
            )
        presented = _digest(given.strip())
        matches = [hmac.compare_digest(presented, known) for known in self._digests]
        if not any(matches):
            raise ApiError(
                401, "incorrect API key provided", kind="invalid_request_error",
                code="invalid_api_key",
            )  # fmt: skip


def collect_keys(
    keys: Iterable[str], key_file: Path | None, environ: Mapping[str, str]
) -> tuple[str, ...]:
    """Every key from the flags, the key file and SPECX_API_KEY, in that order, deduplicated.

    Raises:
        SpecxError: an empty key, a key with whitespace inside, or a key file that cannot
            be read or holds no key.
    """
    found = list(keys)
    if key_file is not None:
        try:
            lines = key_file.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise SpecxError(f"--api-key-file {key_file}: cannot read it ({e})") from None
        from_file = [s.strip() for s in lines if s.strip() and not s.lstrip().startswith("#")]
        if not from_file:
            raise SpecxError(f"--api-key-file {key_file}: holds no key")
        found += from_file
    found += [s.strip() for s in environ.get(ENV_VAR, "").split(",") if s.strip()]
    for i, key in enumerate(found):
        if not key.strip() or any(c.isspace() for c in key.strip()):
            raise SpecxError(
                f"API key #{i + 1} is empty or holds whitespace; keys are single tokens"
            )
    return tuple(dict.fromkeys(k.strip() for k in found))


def check_bind(host: str, access: Access, insecure_no_key: bool) -> None:
    """Refuses to serve an address beyond this machine without a key.

    Raises:
        SpecxError: `host` is not a loopback address, no key is set and the operator did
            not pass --insecure-no-api-key.
    """
    if access.required or insecure_no_key or _loopback(host):
        return
    raise SpecxError(
        f"--host {host} lets other machines reach the server, and no API key is set: pass "
        f"--api-key, --api-key-file or {ENV_VAR}, or --insecure-no-api-key to serve it open"
    )


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False
