"""TLS served directly (`--ssl-certfile`, `--ssl-keyfile`), for deployments without a TLS-terminating proxy.

The context takes TLS 1.2 or newer with Python's default (secure) ciphers; the certificate file may hold the whole
chain. Streams are then at wss://HOST:PORT/v1/stream and the HTTP endpoints at https://.
"""

from __future__ import annotations

import os
import ssl


def server_context(certfile: str | os.PathLike, keyfile: str | os.PathLike | None = None) -> ssl.SSLContext:
    """A server-side SSLContext; ValueError names the file and the problem (missing, unreadable, not matching)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    for flag, path in (("--ssl-certfile", certfile), ("--ssl-keyfile", keyfile)):
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"{flag} {path}: no such file")
    try:
        context.load_cert_chain(certfile, keyfile)
    except ssl.SSLError as error:
        raise ValueError(f"--ssl-certfile {certfile} / --ssl-keyfile {keyfile}: cannot load the certificate and its "
                         f"key ({error.reason or error})") from None
    except OSError as error:
        raise ValueError(f"--ssl-certfile {certfile}: {error.strerror or error}") from None
    return context
