"""Fetching a dataset file over HTTP(S), hashed on the way, so that nothing unverified is kept.

Both downloaders (CIFAR's archive, the IDX files) stream into a temporary file beside the target,
compare the md5 with the published one, and only then rename it into place; a failed, corrupt or
interrupted download leaves nothing behind.
"""
from __future__ import annotations

import hashlib
import urllib.request
from pathlib import Path

TIMEOUT_S = 60


def fetch(url: str, dest: Path) -> str:
    """Stream `url` into `dest`; returns the md5 hex digest of what was written.

    Raises OSError (urllib.error.URLError included; also a body shorter than its Content-Length),
    http.client.HTTPException or ValueError (a malformed URL); the caller deletes `dest`."""
    md5, received = hashlib.md5(), 0
    with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response, open(dest, "wb") as out:
        announced = response.headers.get("Content-Length")
        for chunk in iter(lambda: response.read(1 << 20), b""):
            md5.update(chunk)
            out.write(chunk)
            received += len(chunk)
    # read(n) ends quietly at a dropped connection; the announced length tells a cut from an end
    if announced is not None and announced.isdigit() and received != int(announced):
        raise OSError(f"the connection closed after {received} of {announced} bytes")
    return md5.hexdigest()
