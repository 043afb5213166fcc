"""grpc.health.v1 follows the engine (NOT_SERVING while loading and draining), reflection lists the
services, and the API key guards the moecache services (health and reflection stay open)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from job_servers import ServerThread, engine_config, grpc_options, grpc_target, on_server, poll

from service.grpc_api.stubs import Stubs

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


async def check(channel: grpc.aio.Channel, service: str = "") -> int:
    response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))
    return int(response.status)


async def rpc_error(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


async def test_health_is_not_serving_while_loading_and_draining(tiny_gguf: Path, stubs: Stubs,
                                                               tmp_path: Path) -> None:
    release = threading.Event()
    srv = ServerThread(engine_config(tiny_gguf), grpc_options(tmp_path),
                       progress=lambda *_: release.wait(30)).start(wait_ready=False)
    try:
        await poll(lambda: _value(srv.server.grpc is not None and srv.server.grpc.port))
        async with grpc.aio.insecure_channel(grpc_target(srv)) as channel:
            assert await check(channel) == NOT_SERVING and await check(channel, "moecache.v1.Jobs") == NOT_SERVING
            tokenize = stubs.generation_grpc.GenerationStub(channel).Tokenize
            error = await rpc_error(tokenize(stubs.generation_pb2.TokenizeRequest(prompt="hi")))
            assert error.code() == grpc.StatusCode.UNAVAILABLE and "loading" in error.details()
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
            assert (await watch.read()).status == NOT_SERVING
            release.set()
            assert (await watch.read()).status == SERVING  # the next change: loaded
            assert await check(channel) == SERVING
            await on_server(srv, srv.server.engine.drain(1.0))  # what SIGTERM starts
            assert await check(channel, "moecache.v1.Generation") == NOT_SERVING
            assert (await watch.read()).status == NOT_SERVING
            watch.cancel()
            error = await rpc_error(tokenize(stubs.generation_pb2.TokenizeRequest(prompt="hi")))
            assert error.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in error.details()
    finally:
        release.set()
        srv.stop()


async def _value(value: Any) -> Any:
    return value


async def test_an_unknown_health_service_is_not_found(channel: grpc.aio.Channel) -> None:
    assert await check(channel, "moecache.v1.Generation") == SERVING
    error = await rpc_error(check(channel, "no.such.Service"))
    assert error.code() == grpc.StatusCode.NOT_FOUND


async def test_reflection_lists_the_services_and_their_files(channel: grpc.aio.Channel) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    requests = [reflection_pb2.ServerReflectionRequest(list_services=""),
                reflection_pb2.ServerReflectionRequest(file_containing_symbol="moecache.v1.Jobs")]
    responses = [r async for r in stub.ServerReflectionInfo(iter(requests))]
    names = {s.name for s in responses[0].list_services_response.service}
    assert {"moecache.v1.Generation", "moecache.v1.Jobs", "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection"} <= names
    files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
             for raw in responses[1].file_descriptor_response.file_descriptor_proto]
    jobs = next(f for f in files if f.name == "moecache/v1/jobs.proto")
    assert [m.name for m in jobs.service[0].method] == ["Submit", "Get", "List", "Watch", "Cancel"]
    assert "moecache/v1/generation.proto" in jobs.dependency


async def test_the_api_key_guards_the_moecache_services_only(tiny_gguf: Path, stubs: Stubs, tmp_path: Path) -> None:
    srv = ServerThread(engine_config(tiny_gguf), grpc_options(tmp_path, api_key="s3cret")).start()
    request = stubs.generation_pb2.TokenizeRequest(prompt="hi")
    try:
        async with grpc.aio.insecure_channel(grpc_target(srv)) as channel:
            tokenize = stubs.generation_grpc.GenerationStub(channel).Tokenize
            for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", "s3cret"),)):
                error = await rpc_error(tokenize(request, metadata=metadata))
                assert error.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in error.details()
            good = (("authorization", "Bearer s3cret"),)
            assert list((await tokenize(request, metadata=good)).token_ids)
            get = stubs.jobs_grpc.JobsStub(channel).Get
            assert (await rpc_error(get(stubs.jobs_pb2.GetJobRequest(id="job_x")))).code() == \
                grpc.StatusCode.UNAUTHENTICATED
            error = await rpc_error(get(stubs.jobs_pb2.GetJobRequest(id="job_x"), metadata=good))
            assert error.code() == grpc.StatusCode.NOT_FOUND
            assert await check(channel) == SERVING  # probes need no key
    finally:
        srv.stop()
