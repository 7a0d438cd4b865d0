"""Images from the bytes a request carries, and chat content parts for the template: shared by
the offline `LLM.chat` and `kvtier serve` (server/media.py adds where images may come from).

Checks run before decoding: the bytes against a limit, then the header's size against a pixel
limit (a small file can claim a huge image), then the decode. Every refusal is a `MediaError`
(a ValueError) naming the problem.
"""
from __future__ import annotations

import base64
import binascii
import io
from typing import Any

# What PIL may decode, by a data URL's media type (and the decoded file's format).
IMAGE_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP",
               "image/gif": "GIF", "image/bmp": "BMP"}
# Content part types OpenAI (or vLLM) defines that kvtier does not take: refused by name.
REFUSED_PARTS = ("input_audio", "audio_url", "video_url", "file", "image_embeds")
IMAGE_PARTS = ("image_url", "image_pil")  # OpenAI's, and vLLM's offline one (a PIL image)


class MediaError(ValueError):
    """An image or content part that is refused; the message names why."""


def template_parts(parts: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the content as the chat template sees it: text parts and {"type": "image"} where an image
    goes, the image parts in order); MediaError for a part that is neither."""
    content: list[dict[str, Any]] = []
    images: list[dict[str, Any]] = []
    for part in parts:
        kind = part.get("type")
        if kind == "text" and isinstance(part.get("text"), str):
            content.append({"type": "text", "text": part["text"]})
        elif kind in IMAGE_PARTS:
            content.append({"type": "image"})
            images.append(part)
        elif kind in REFUSED_PARTS:
            raise MediaError(f"content part type {kind!r} is not supported (text and image_url are)")
        else:
            raise MediaError(f"unknown content part type {kind!r} (text and image_url are supported)")
    return content, images


def image_url(part: dict[str, Any]) -> str:
    """The URL of an image_url part; MediaError when it has none."""
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str):
        raise MediaError('an image_url part needs {"image_url": {"url": "data:image/...;base64,..."}}')
    return url


def data_url_bytes(url: str, max_bytes: int) -> tuple[bytes, str]:
    """(the bytes, the PIL format its media type names) of a `data:image/...;base64,` URL."""
    head, sep, body = url[5:].partition(",")
    parts = head.split(";")
    mime = parts[0].strip().lower()
    if not url[:5].lower() == "data:" or not sep or "base64" not in parts[1:]:
        raise MediaError("malformed data URL: expected data:image/<type>;base64,<data>")
    if mime not in IMAGE_TYPES:
        raise MediaError(f"unsupported image type {mime or '(none)'!r} (supported: {', '.join(sorted(IMAGE_TYPES))})")
    if len(body) * 3 // 4 > max_bytes:
        raise MediaError(f"image of about {len(body) * 3 // 4} bytes exceeds the limit of {max_bytes} bytes "
                         "(--max-image-bytes)")
    try:
        return base64.b64decode(body, validate=True), IMAGE_TYPES[mime]
    except (binascii.Error, ValueError):
        raise MediaError("malformed data URL: its data is not valid base64") from None


def decode_image(raw: bytes, declared: str | None, max_bytes: int, max_pixels: int) -> Any:
    """The RGB PIL image in `raw` (whose format must be `declared`, when given)."""
    from PIL import Image, UnidentifiedImageError

    if len(raw) > max_bytes:
        raise MediaError(f"image of {len(raw)} bytes exceeds the limit of {max_bytes} bytes (--max-image-bytes)")
    try:
        im = Image.open(io.BytesIO(raw))  # reads the header only
    except (UnidentifiedImageError, OSError, ValueError):
        raise MediaError("the image data is not an image this server can read "
                         f"({', '.join(sorted(set(IMAGE_TYPES.values())))})") from None
    if im.format not in IMAGE_TYPES.values() or (declared is not None and im.format != declared):
        raise MediaError(f"the image data is {im.format}, not the declared {declared or 'a supported type'}")
    w, h = im.size
    if w * h > max_pixels:
        raise MediaError(f"image of {w}x{h} = {w * h} pixels exceeds the limit of {max_pixels} (--max-image-pixels)")
    try:
        im.load()
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise MediaError(f"the image data is damaged: {e}") from None
    return im.convert("RGB")
