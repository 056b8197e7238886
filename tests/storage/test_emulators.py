"""What the emulators themselves enforce, shown request by request.

The conformance suite runs against fake-gcs-server and Azurite (``test_conformance.py``); these
tests pin down the emulator behaviour it relies on, so a new emulator version that changes it
fails here, by name, instead of as a puzzling conformance failure. ``docs/storage.md`` sums
them up.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from statekeeper.errors import CommitConflictError
from statekeeper.storage import open_blob_store
from tests.storage.emulators import AZURITE_ACCOUNT, AZURITE_KEY, Azurite, FakeGcs, new_name


def http(
    method: str, url: str, body: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    """One request; the status and body, whatever the status."""
    request = urllib.request.Request(url, data=body, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


# -- fake-gcs-server -------------------------------------------------------------------------------


@pytest.fixture
def bucket(gcs_server: FakeGcs) -> str:
    name = new_name("sk-emu")
    gcs_server.create_bucket(name)
    return name


def multipart_upload(server: FakeGcs, bucket: str, name: str, data: bytes, query: str) -> int:
    boundary = "b0undary"
    body = b"".join(
        [
            f"--{boundary}\r\nContent-Type: application/json\r\n\r\n".encode(),
            json.dumps({"name": name}).encode(),
            f"\r\n--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n".encode(),
            data,
            f"\r\n--{boundary}--\r\n".encode(),
        ]
    )
    status, _ = http(
        "POST",
        f"{server.upstream}/upload/storage/v1/b/{bucket}/o?uploadType=multipart&{query}",
        body,
        {"Content-Type": f"multipart/related; boundary={boundary}"},
    )
    return status


def media_upload(server: FakeGcs, bucket: str, name: str, data: bytes, query: str) -> int:
    status, _ = http(
        "POST",
        f"{server.upstream}/upload/storage/v1/b/{bucket}/o?uploadType=media&name={name}&{query}",
        data,
        {"Content-Type": "application/octet-stream"},
    )
    return status


def read_object(server: FakeGcs, bucket: str, name: str) -> bytes:
    status, body = http("GET", f"{server.upstream}/{bucket}/{name}")
    assert status == 200
    return body


@pytest.mark.gcs
def test_fake_gcs_has_no_xml_api_put(gcs_server: FakeGcs, bucket: str) -> None:
    """The request obstore sends to write an object is refused: hence the bridge."""
    status, body = http(
        "PUT",
        f"{gcs_server.upstream}/{bucket}/k",
        b"data",
        {"x-goog-if-generation-match": "0", "Content-Type": "application/octet-stream"},
    )
    assert (status, b"invalid uploadType" in body) == (400, True)
    assert http("GET", f"{gcs_server.upstream}/{bucket}/k")[0] == 404


@pytest.mark.gcs
def test_fake_gcs_multipart_upload_enforces_generation_match(
    gcs_server: FakeGcs, bucket: str
) -> None:
    """What the bridge sends: ifGenerationMatch=0 is create-only, =<generation> compare-and-set."""
    assert multipart_upload(gcs_server, bucket, "k", b"first", "ifGenerationMatch=0") == 200
    assert multipart_upload(gcs_server, bucket, "k", b"second", "ifGenerationMatch=0") == 412
    assert read_object(gcs_server, bucket, "k") == b"first"
    status, body = http("GET", f"{gcs_server.upstream}/storage/v1/b/{bucket}/o/k")
    assert status == 200
    generation = json.loads(body)["generation"]
    assert multipart_upload(gcs_server, bucket, "k", b"third", "ifGenerationMatch=1") == 412
    assert (
        multipart_upload(gcs_server, bucket, "k", b"4th", f"ifGenerationMatch={generation}") == 200
    )
    assert read_object(gcs_server, bucket, "k") == b"4th"


@pytest.mark.gcs
def test_fake_gcs_media_upload_ignores_generation_match(gcs_server: FakeGcs, bucket: str) -> None:
    """Not enforced: a simple (media) upload overwrites despite ifGenerationMatch=0.

    So the bridge must not use media uploads. (Fixed upstream after 1.54, the version the
    wrapper bundles; when this starts failing, the emulator enforces it here too.)
    """
    assert media_upload(gcs_server, bucket, "k", b"first", "ifGenerationMatch=0") == 200
    assert media_upload(gcs_server, bucket, "k", b"second", "ifGenerationMatch=0") == 200
    assert read_object(gcs_server, bucket, "k") == b"second"


@pytest.mark.gcs
def test_create_only_put_through_obstore_is_refused_by_the_emulator(
    gcs_server: FakeGcs, gcs_root: tuple[str, dict[str, str]]
) -> None:
    uri, options = gcs_root
    store = open_blob_store(uri, options)
    bridged = gcs_server.bridged_puts
    store.put("c/k", b"original")
    with pytest.raises(CommitConflictError, match="c/k"):
        store.put("c/k", b"intruder")
    assert gcs_server.bridged_puts == bridged + 2  # both went through the bridge to the emulator
    bucket = uri.removeprefix("gs://").split("/", 1)[0]
    assert read_object(gcs_server, bucket, "root/c/k") == b"original"


# -- Azurite --------------------------------------------------------------------------------------


@pytest.fixture
def container(azurite_server: Azurite) -> str:
    name = new_name("sk-emu")
    azurite_server.create_container(name)
    return name


@pytest.mark.azure
def test_azurite_enforces_if_none_match_and_if_match(
    azurite_server: Azurite, container: str
) -> None:
    """Azurite refuses a create-only write (409) and a stale If-Match (412), as Azure does."""
    from azure.core import MatchConditions
    from azure.core.exceptions import ResourceExistsError, ResourceModifiedError
    from azure.storage.blob import BlobClient

    blob = BlobClient(
        account_url=azurite_server.endpoint,
        container_name=container,
        blob_name="k",
        credential={"account_name": AZURITE_ACCOUNT, "account_key": AZURITE_KEY},
    )
    with blob:
        first = blob.upload_blob(b"first")  # overwrite=False sends If-None-Match: *
        with pytest.raises(ResourceExistsError) as exists:
            blob.upload_blob(b"second")
        assert exists.value.status_code == 409
        blob.upload_blob(b"third", overwrite=True)
        with pytest.raises(ResourceModifiedError) as modified:
            blob.upload_blob(
                b"fourth",
                overwrite=True,
                etag=first["etag"],
                match_condition=MatchConditions.IfNotModified,
            )
        assert modified.value.status_code == 412
        assert blob.download_blob().readall() == b"third"
