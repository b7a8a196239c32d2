#!/usr/bin/env python3
"""Container health check: exit 0 when GET /health on the local server answers 200, else 1.

Both images use it (neither ships curl in its final stage). The port is KVPRESS_PORT, as the
entrypoint binds it; only the standard library is used so the check stays cheap.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request


def main() -> int:
    port = os.environ.get("KVPRESS_PORT", "8000")
    url = f"http://127.0.0.1:{port}/health"
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            ok = response.status == 200
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"health check {url}: {exc}", file=sys.stderr)
        return 1
    if not ok:
        print(f"health check {url}: status {response.status}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
