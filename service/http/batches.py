"""OpenAI's Files and Batch APIs over jobs: `/v1/files` (purpose `batch`, JSONL) and `/v1/batches`."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from aiohttp import BodyPartReader, web

from service.http.errors import content_coding, read_json
from service.http.jobs import page_limit, page_object
from service.http.state import jobs_of
from service.jobs.api import check_cursor, is_id
from service.jobs.records import Batch, FileObject
from service.jobs.store import window_seconds
from service.openai.body import Body
from service.openai.errors import ApiError, bad_request, printable
from service.openai.kinds import ENDPOINT_KINDS

CHUNK_BYTES = 1 << 16
MAX_FILENAME_CHARS = 255
# OpenAI's limits on a batch's metadata
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512


def file_object(file: FileObject) -> dict[str, Any]:
    return {**dataclasses.asdict(file), "status": "processed", "status_details": None, "expires_at": None}


def batch_object(batch: Batch) -> dict[str, Any]:
    return dataclasses.asdict(batch)


def file_not_found(file_id: str) -> ApiError:
    return ApiError(404, f"no file {file_id[:100]!r}", "file_id", "not_found")


# -- files ---------------------------------------------------------------------------------------------
async def upload_file(request: web.Request) -> web.Response:
    """multipart/form-data with `purpose` (must be `batch`) and `file`; read in chunks, so the size
    limit holds without buffering more than it."""
    jobs = jobs_of(request)
    fields = await read_upload(request, jobs.options.max_file_bytes)
    if fields.get("purpose") != "batch":
        raise bad_request("purpose must be 'batch' (the only files this server uses)", "purpose")
    if "file" not in fields:
        raise bad_request("the form has no file part", "file")
    filename, data = fields["file"]
    file = await asyncio.to_thread(jobs.store.create_file, "batch", filename, data)
    return web.json_response(file_object(file))


async def read_upload(request: web.Request, max_bytes: int) -> dict[str, Any]:
    if not request.content_type.startswith("multipart/"):
        raise bad_request("upload the file as multipart/form-data")
    if content_coding(request) != "identity":
        raise ApiError(415, "send the multipart form without a Content-Encoding", code="unsupported_content_encoding")
    try:
        return await read_parts(request, max_bytes)
    except (ValueError, AssertionError) as error:  # what aiohttp's multipart reader raises on a malformed form
        raise bad_request(f"the multipart form is malformed: {str(error)[:200]}") from None


async def read_parts(request: web.Request, max_bytes: int) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    async for part in await request.multipart():
        if not isinstance(part, BodyPartReader):
            continue
        if part.name == "file":
            fields["file"] = (filename_of(part), await read_part(part, max_bytes))
        elif part.name == "purpose":
            fields["purpose"] = (await read_part(part, 1024)).decode(errors="replace")
    return fields


def filename_of(part: BodyPartReader) -> str:
    """The part's file name as stored: valid Unicode, and short."""
    return printable(part.filename or "upload.jsonl").replace("\x00", "")[:MAX_FILENAME_CHARS] or "upload.jsonl"


async def read_part(part: BodyPartReader, max_bytes: int) -> bytes:
    data = bytearray()
    while chunk := await part.read_chunk(CHUNK_BYTES):
        data += chunk
        if len(data) > max_bytes:
            raise ApiError(413, f"the file is larger than {max_bytes} bytes", "file", "file_too_large")
    return bytes(data)


def file_id_of(request: web.Request) -> str:
    file_id = request.match_info["file_id"]
    if not is_id(file_id):
        raise file_not_found(file_id)
    return file_id


def batch_id_of(request: web.Request) -> str:
    batch_id = request.match_info["batch_id"]
    if not is_id(batch_id):
        raise batch_not_found(batch_id)
    return batch_id


async def get_file(request: web.Request) -> web.Response:
    file_id = file_id_of(request)
    file = await asyncio.to_thread(jobs_of(request).store.get_file, file_id)
    if file is None:
        raise file_not_found(file_id)
    return web.json_response(file_object(file))


async def file_content(request: web.Request) -> web.Response:
    file_id = file_id_of(request)
    data = await asyncio.to_thread(jobs_of(request).store.file_content, file_id)
    if data is None:
        raise file_not_found(file_id)
    return web.Response(body=data, content_type="application/jsonl")


async def list_files(request: web.Request) -> web.Response:
    limit = page_limit(request)
    purpose, after = request.query.get("purpose"), check_cursor(request.query.get("after"))
    if purpose is not None and not is_id(purpose):
        raise bad_request(f"purpose must be a name like 'batch' (got {purpose[:40]!r})", "purpose")
    files = await asyncio.to_thread(jobs_of(request).store.list_files, purpose=purpose, limit=limit + 1, after=after)
    return web.json_response(page_object([file_object(f) for f in files[:limit]], len(files) > limit))


async def delete_file(request: web.Request) -> web.Response:
    file_id = file_id_of(request)
    if not await asyncio.to_thread(jobs_of(request).store.delete_file, file_id):
        raise file_not_found(file_id)
    return web.json_response({"id": file_id, "object": "file", "deleted": True})


# -- batches -------------------------------------------------------------------------------------------
async def create_batch(request: web.Request) -> web.Response:
    jobs, body = jobs_of(request), Body(await read_json(request))
    input_file_id, endpoint = body.string("input_file_id"), body.string("endpoint")
    window = body.string("completion_window", "24h") or "24h"
    if endpoint not in ENDPOINT_KINDS:
        raise bad_request(f"endpoint must be one of {', '.join(ENDPOINT_KINDS)} (got {str(endpoint)[:100]!r})",
                          "endpoint")
    file_id = input_file_id or ""
    file = await asyncio.to_thread(jobs.store.get_file, file_id) if is_id(file_id) else None
    if input_file_id is None or file is None:
        raise ApiError(404, f"no input file {str(input_file_id)[:100]!r}", "input_file_id", "not_found")
    if file.purpose != "batch":
        raise bad_request(f"the input file's purpose is {file.purpose!r}, not 'batch'", "input_file_id")
    try:
        window_seconds(window)
    except ValueError as error:
        raise bad_request(str(error), "completion_window") from None
    metadata = check_metadata(body.raw("metadata"))
    batch = await asyncio.to_thread(jobs.batches.create, file_id, endpoint, window, metadata)
    jobs.wake_worker()
    return web.json_response(batch_object(batch))


def check_metadata(metadata: Any) -> dict[str, str] | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise bad_request("metadata must be an object of strings", "metadata")
    if len(metadata) > MAX_METADATA_PAIRS or any(len(k) > MAX_METADATA_KEY_CHARS or len(v) > MAX_METADATA_VALUE_CHARS
                                                 for k, v in metadata.items()):
        raise bad_request(f"metadata holds at most {MAX_METADATA_PAIRS} pairs, keys of at most "
                          f"{MAX_METADATA_KEY_CHARS} and values of at most {MAX_METADATA_VALUE_CHARS} characters",
                          "metadata")
    return metadata


async def get_batch(request: web.Request) -> web.Response:
    batch_id = batch_id_of(request)
    batch = await asyncio.to_thread(jobs_of(request).store.get_batch, batch_id)
    if batch is None:
        raise batch_not_found(batch_id)
    return web.json_response(batch_object(batch))


def batch_not_found(batch_id: str) -> ApiError:
    return ApiError(404, f"no batch {batch_id[:100]!r}", "batch_id", "not_found")


async def cancel_batch(request: web.Request) -> web.Response:
    batch_id = batch_id_of(request)
    batch = await jobs_of(request).cancel_batch(batch_id)
    if batch is None:
        raise batch_not_found(batch_id)
    return web.json_response(batch_object(batch))


async def list_batches(request: web.Request) -> web.Response:
    limit = page_limit(request)
    batches = await asyncio.to_thread(jobs_of(request).store.list_batches, limit=limit + 1,
                                      after=check_cursor(request.query.get("after")))
    return web.json_response(page_object([batch_object(b) for b in batches[:limit]], len(batches) > limit))


def routes() -> list[web.RouteDef]:
    return [
        web.post("/v1/files", upload_file),
        web.get("/v1/files", list_files),
        web.get("/v1/files/{file_id}", get_file),
        web.delete("/v1/files/{file_id}", delete_file),
        web.get("/v1/files/{file_id}/content", file_content),
        web.post("/v1/batches", create_batch),
        web.get("/v1/batches", list_batches),
        web.get("/v1/batches/{batch_id}", get_batch),
        web.post("/v1/batches/{batch_id}/cancel", cancel_batch),
    ]
