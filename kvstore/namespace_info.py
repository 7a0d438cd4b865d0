"""Namespace records: what model a G3/G4 namespace belongs to, for the `kvtier kv` tools.

A namespace is a 16-byte digest (engine/kv/fingerprint.py), which says nothing to an operator. So
when a tier opens it writes a small JSON record beside its entries:

    G3: {root}/{namespace.hex()}/namespace.json
    G4: {prefix}:{namespace.hex()}:namespace

holding the model (path), its dtype and what the fingerprint was computed from. The record is
informational only: no tier ever reads it, nothing is decided from it, it is parsed as JSON and
nothing else (never unpickled), and a missing, oversized or garbled record shows as "unknown".
Writing it is best effort: a failure is logged at debug level and the tier works as before.
"""
from __future__ import annotations

import json
import logging
import os
import secrets
from collections.abc import Mapping
from typing import Any

from kvstore.disk_layout import unlink_quietly, write_all

logger = logging.getLogger(__name__)

RECORD_NAME = "namespace.json"  # in a G3 namespace directory (not a shard: the tier never lists it)
REDIS_SUFFIX = "namespace"  # the G4 key's last part, where an entry has its 32 hex digits
RECORD_VERSION = 1
MAX_RECORD_BYTES = 64 << 10  # a record is a few hundred bytes; anything far larger is not ours
UNKNOWN = "unknown"


def check_info(info: Mapping[str, Any] | None) -> None:
    """ValueError unless `info` is None or a JSON object of at most MAX_RECORD_BYTES."""
    if info is None:
        return
    if not isinstance(info, Mapping) or not all(isinstance(k, str) for k in info):
        raise ValueError("namespace info must be a mapping with string keys")
    try:
        size = len(json.dumps(dict(info), sort_keys=True))
    except (TypeError, ValueError) as e:
        raise ValueError(f"namespace info must be JSON-serialisable: {e}") from None
    if size > MAX_RECORD_BYTES // 2:  # room for the fields encode_record adds
        raise ValueError(f"namespace info is {size} bytes of JSON; at most {MAX_RECORD_BYTES // 2}")


def encode_record(namespace: bytes, info: Mapping[str, Any]) -> bytes:
    """The record's bytes: `info` plus the record version and the namespace it describes."""
    record = {**info, "record_version": RECORD_VERSION, "namespace": namespace.hex()}
    return json.dumps(record, sort_keys=True, indent=1).encode() + b"\n"


def parse_record(raw: bytes | None) -> dict[str, Any] | None:
    """The record as a dict, or None when missing, oversized, not UTF-8 JSON, or not an object."""
    if raw is None or len(raw) > MAX_RECORD_BYTES:
        return None
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def model_label(record: Mapping[str, Any] | None) -> str:
    """A one-line "model (dtype)" for a record; "unknown" when there is none or it names no model."""
    if record is None or not isinstance(record.get("model"), str) or not record["model"]:
        return UNKNOWN
    dtype = record.get("kv_dtype") or record.get("dtype")
    return f"{record['model']} ({dtype})" if isinstance(dtype, str) else record["model"]


def redis_record_key(prefix: str, namespace: bytes) -> str:
    return f"{prefix}:{namespace.hex()}:{REDIS_SUFFIX}"


def read_disk_record(ns_dir: str) -> dict[str, Any] | None:
    """The namespace directory's record; None when missing, unreadable or garbled."""
    path = os.path.join(ns_dir, RECORD_NAME)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_RECORD_BYTES + 1)
    except OSError:  # missing or unreadable: the record is optional
        return None
    return parse_record(raw)


def write_disk_record(ns_dir: str, namespace: bytes, info: Mapping[str, Any]) -> None:
    """Write the record atomically (temp file + rename, 0600), unless it already says the same.
    Best effort: an OSError is logged at debug level, never raised."""
    data = encode_record(namespace, info)
    path = os.path.join(ns_dir, RECORD_NAME)
    try:
        with open(path, "rb") as f:
            if f.read(MAX_RECORD_BYTES + 1) == data:
                return
    except OSError:  # missing (first open) or unreadable: write it
        pass
    tmp = os.path.join(ns_dir, f".{RECORD_NAME}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            write_all(fd, memoryview(data))
        finally:
            os.close(fd)
        os.replace(tmp, path)  # readers see the old record or the new one, never half of one
    except OSError as e:
        logger.debug("cannot write the namespace record %s: %s", path, e)
        unlink_quietly(tmp)
