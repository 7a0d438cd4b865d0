"""Images in chat requests (`kvtier serve` on a model that takes them): where an image may come
from, how big it may be, and turning OpenAI's content parts into what the chat template and the
checkpoint's processor take.

Sources, as in vLLM: `data:` URLs always; `http(s)` only from --allowed-media-domains; `file:` only
under --allowed-local-media-path. Every refusal is a `MediaError` naming the problem (the API
answers 400); none reaches the engine core. The bytes and pixels are checked before decoding
(engine/mm/images.py).
"""
from __future__ import annotations

import enum
import json
import os
import urllib.parse
import urllib.request
from dataclasses import dataclass, fields
from typing import Any

from engine.config import setting
from engine.mm.images import MediaError, data_url_bytes, decode_image, image_url, template_parts


class MediaGroup(str, enum.Enum):
    MEDIA = "images (models that take them)"


@dataclass(frozen=True)
class MediaSettings:
    allowed_local_media_path: str | None = setting(
        None, "a directory whose files requests may name as file:// image URLs (default: none: file URLs are refused)",
        group=MediaGroup.MEDIA, metavar="DIR")
    allowed_media_domains: str | None = setting(
        None, "comma-separated host names http(s) image URLs may be fetched from (default: none: such URLs are "
        "refused; data: URLs need no flag)", group=MediaGroup.MEDIA, metavar="HOSTS")
    limit_mm_per_prompt: str | None = setting(
        None, 'most items per prompt by modality, as JSON, e.g. \'{"image": 4}\' (default: {"image": 8}); a '
        "request over it gets 400", group=MediaGroup.MEDIA, metavar="JSON")
    max_image_pixels: int = setting(
        16 * 2**20, "largest image, in pixels, a request may send (checked before decoding; default: %(default)s)",
        group=MediaGroup.MEDIA)
    max_image_bytes: int = setting(
        20 * 2**20, "largest image file a request may send or make the server fetch (default: 20 MiB)",
        group=MediaGroup.MEDIA)
    media_fetch_timeout: float = setting(
        5.0, "seconds an http(s) image may take to fetch (default: %(default)s)", group=MediaGroup.MEDIA,
        metavar="SECONDS")

    def __post_init__(self) -> None:
        if self.max_image_pixels < 1 or self.max_image_bytes < 1 or self.media_fetch_timeout <= 0:
            raise ValueError("--max-image-pixels, --max-image-bytes and --media-fetch-timeout must be > 0")
        if self.allowed_local_media_path is not None and not os.path.isdir(self.allowed_local_media_path):
            raise ValueError(f"--allowed-local-media-path {self.allowed_local_media_path}: not a directory")
        _ = self.images_per_prompt  # a malformed --limit-mm-per-prompt fails here

    @property
    def images_per_prompt(self) -> int:
        if self.limit_mm_per_prompt is None:
            return 8
        try:
            limits = json.loads(self.limit_mm_per_prompt)
        except json.JSONDecodeError as e:
            raise ValueError(f"--limit-mm-per-prompt is not JSON: {e}") from None
        if not isinstance(limits, dict) or set(limits) - {"image"} or not all(
                type(v) is int and v >= 0 for v in limits.values()):
            raise ValueError('--limit-mm-per-prompt takes {"image": N} (N >= 0): images are the one modality served; '
                             f"got {self.limit_mm_per_prompt}")
        return limits.get("image", 8)

    @property
    def domains(self) -> frozenset[str]:
        return frozenset(d.strip().lower() for d in (self.allowed_media_domains or "").split(",") if d.strip())

    def changed(self) -> list[str]:
        """The flags set away from their defaults (refused on a model that takes no images)."""
        return ["--" + f.name.replace("_", "-") for f in fields(self) if getattr(self, f.name) != f.default]

    @classmethod
    def from_flags(cls, ns: Any) -> MediaSettings:
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls)})


def image_urls(content: list[dict[str, Any]]) -> list[str]:
    """The image URLs of a message's content parts, in order; MediaError for a part that is not
    text or an image_url."""
    _, parts = template_parts(content)
    for p in parts:
        if p["type"] != "image_url":
            raise MediaError(f"content part type {p['type']!r} is not supported over HTTP (image_url is)")
    return [image_url(p) for p in parts]


def load_image(url: str, s: MediaSettings) -> Any:
    """The RGB PIL image `url` names, after the source and size checks (MediaError otherwise)."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        raw, declared = data_url_bytes(url, s.max_image_bytes)
    elif scheme in ("http", "https"):
        raw, declared = _fetch(url, s), None
    elif scheme == "file":
        raw, declared = _local(url, s), None
    else:
        raise MediaError(f"image URL scheme {scheme or url[:16]!r} is not supported (data:, and http(s) or file "
                         "with the server's --allowed-media-domains or --allowed-local-media-path)")
    return decode_image(raw, declared, s.max_image_bytes, s.max_image_pixels)


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect could lead off the allowed hosts (to an internal address): refused."""

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> None:
        raise MediaError(f"image URL {req.full_url} redirects ({code}) to {newurl}: redirects are not followed")


_OPENER = urllib.request.build_opener(_NoRedirects)


def _fetch(url: str, s: MediaSettings) -> bytes:
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    if host not in s.domains:
        raise MediaError(f"image URL host {host!r} is not allowed (the server's --allowed-media-domains "
                         f"{'lists ' + ', '.join(sorted(s.domains)) if s.domains else 'is not set'})")
    try:
        with _OPENER.open(url, timeout=s.media_fetch_timeout) as r:
            return r.read(s.max_image_bytes + 1)  # one more than allowed: decode_image refuses it by size
    except OSError as e:
        raise MediaError(f"cannot fetch image {url}: {e}") from None


def _local(url: str, s: MediaSettings) -> bytes:
    if s.allowed_local_media_path is None:
        raise MediaError("file:// image URLs need the server's --allowed-local-media-path")
    parsed = urllib.parse.urlsplit(url)
    if parsed.netloc not in ("", "localhost"):
        raise MediaError(f"file URL host {parsed.netloc!r}: only local files are served")
    path = os.path.realpath(urllib.parse.unquote(parsed.path))
    root = os.path.realpath(s.allowed_local_media_path)
    if os.path.commonpath([path, root]) != root:
        raise MediaError(f"image path {urllib.parse.unquote(parsed.path)} is outside --allowed-local-media-path")
    try:
        with open(path, "rb") as f:
            return f.read(s.max_image_bytes + 1)
    except OSError as e:
        raise MediaError(f"cannot read image {urllib.parse.unquote(parsed.path)}: {e.strerror}") from None
