"""Images in chat requests, as every dialect sends them (OpenAI data URLs, Ollama's bare
base64, Anthropic's base64 source blocks), checked once into protocol.ImageInput.

An image is taken only inline: a remote URL is refused, never fetched (the server would
otherwise reach any address a client names). Its bytes are bounded, and its type is read
from its own first bytes, so a corrupt or non-image payload is the client's 400 here, not a
failure inside the model's backend.
"""

from __future__ import annotations

import base64
import binascii

from shoal.api.errors import invalid_parameter
from shoal.protocol import ImageInput, ImageMediaType

# Per image, decoded (OpenAI's own bound is 20 MB, Anthropic's 5 MB; a projector sees a
# few hundred pixels a side, so more only costs the server memory).
MAX_IMAGE_BYTES = 10 * 1024 * 1024

# Each type's leading bytes: the types llama.cpp's image loader (stb_image) decodes that
# clients send (no WebP: stb_image cannot read it).
_SIGNATURES: tuple[tuple[bytes, ImageMediaType], ...] = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
    (b"BM", "image/bmp"),
)


def image_from_base64(data: str, param: str) -> ImageInput:
    """The image that base64 text encodes (bare, as Ollama and Anthropic send it)."""
    if not isinstance(data, str) or not data:
        raise invalid_parameter(param, "an image must be base64 text")
    if len(data) * 3 // 4 > MAX_IMAGE_BYTES + 3:  # refused before decoding it
        raise _too_large(param)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise invalid_parameter(param, "the image is not valid base64") from None
    if len(raw) > MAX_IMAGE_BYTES:
        raise _too_large(param)
    media_type = _sniff(raw)
    if media_type is None:
        raise invalid_parameter(param, "the image is not a PNG, JPEG, GIF or BMP file")
    return ImageInput(media_type=media_type, data=raw)


def image_from_url(url: str, param: str) -> ImageInput:
    """The image of a `data:image/...;base64,` URL (OpenAI's image_url); any other URL is
    refused: shoal does not fetch images."""
    header, comma, data = url.partition(",")
    if not header.startswith("data:"):
        raise invalid_parameter(param, "only data URLs (data:image/png;base64,...) are "
                                       "taken; shoal does not fetch images from URLs")
    if not comma or not header.endswith(";base64") or not header.startswith("data:image/"):
        raise invalid_parameter(param, "an image data URL must read "
                                       "data:image/<type>;base64,<data>")
    return image_from_base64(data, param)


def _sniff(raw: bytes) -> ImageMediaType | None:
    for signature, media_type in _SIGNATURES:
        if raw.startswith(signature):
            return media_type
    return None


def _too_large(param: str):
    return invalid_parameter(param, f"the image is larger than "
                                    f"{MAX_IMAGE_BYTES // (1024 * 1024)} MiB")
