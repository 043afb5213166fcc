"""gRPC calls of the fuzz test (raw request bytes over a real channel) and their oracle: never UNKNOWN,
INTERNAL or DATA_LOSS, no exception class in a status message, and a stream ends with its last message
(Finished, the finished Job) or a status."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import math
import re
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import descriptor, json_format
from google.protobuf.message import DecodeError
from hypothesis import strategies as st

from service.grpc_api.stubs import Stubs

FORBIDDEN = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DATA_LOSS}
EXCEPTION_NAME = re.compile(r"\b[A-Z]\w*(Error|Exception|Warning)\b|Traceback|<class ")
CALL_TIMEOUT_S = 30.0
STREAM_READ_S = 10.0
Draw = Any

UINTS = (0, 1, 2, 16, 20, 100, 101, 255, 256, 4095, 4096, 2**31 - 1, 2**31, 2**32 - 1)
UINT64S = (*UINTS, 2**32, 2**53, 2**63 - 1, 2**63, 2**64 - 1)
SINTS = (0, 1, -1, -2, 2**31 - 1, -(2**31))
DOUBLES = (0.0, -0.0, 0.5, 1.0, 2.0, 101.0, 1e308, -1e308, 1e-320, math.inf, -math.inf, math.nan)
STRINGS = ("", "tiny", "hello", "user", "assistant", "x" * 3000, "\x00", "😀", "²", "٣", "{}", "job_nope")


@dataclass(frozen=True)
class GrpcCase:
    method: str  # /package.Service/Method
    request: bytes
    metadata: tuple[tuple[str, str], ...] = ()
    name: str = ""
    expect: str | None = None  # the status code name a corpus case must get


@dataclass
class GrpcOutcome:
    case: GrpcCase
    code: grpc.StatusCode = grpc.StatusCode.OK
    details: str = ""
    messages: list[bytes] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def describe(self) -> str:
        c = self.case
        return (f"{c.name} {c.method} {c.request[:200]!r} {list(c.metadata)} -> {self.code.name} "
                f"{self.details[:200]!r}: {'; '.join(self.problems)}")


class Methods:
    """The request and response types of every method of the served services."""

    def __init__(self, stubs: Stubs) -> None:
        from grpc_health.v1 import health_pb2

        files = (stubs.generation_pb2.DESCRIPTOR, stubs.jobs_pb2.DESCRIPTOR, health_pb2.DESCRIPTOR)
        self.methods: dict[str, descriptor.MethodDescriptor] = {
            f"/{service.full_name}/{method.name}": method
            for file in files for service in file.services_by_name.values() for method in service.methods
            if method.name != "Watch" or service.name != "Health"}  # Health.Watch never ends by design
        self._classes = {**_classes(stubs.generation_pb2), **_classes(stubs.jobs_pb2), **_classes(health_pb2)}

    def message(self, method: str, value: dict[str, Any] | None = None) -> Any:
        cls = self._classes[self.methods[method].input_type.full_name]
        return json_format.ParseDict(value or {}, cls())

    def response_class(self, method: str) -> Any:
        return self._classes[self.methods[method].output_type.full_name]

    def is_streaming(self, method: str) -> bool:
        return bool(self.methods[method].server_streaming)


def _classes(module: Any) -> dict[str, Any]:
    return {d.full_name: getattr(module, name) for name, d in module.DESCRIPTOR.message_types_by_name.items()}


def case_from_corpus(line: dict[str, Any], methods: Methods, key: str) -> GrpcCase:
    if "b64" in line:
        request = base64.b64decode(line["b64"])
    else:
        request = methods.message(line["method"], line.get("message")).SerializeToString()
    metadata = tuple((k, v.replace("{key}", key)) for k, v in line.get("metadata", [["authorization", "Bearer {key}"]]))
    return GrpcCase(line["method"], request, metadata, line.get("name", ""), line.get("expect"))


async def call(channel: grpc.aio.Channel, case: GrpcCase, streaming: bool) -> GrpcOutcome:
    outcome = GrpcOutcome(case)
    try:
        if streaming:
            await _read_stream(channel, case, outcome)
        else:
            outcome.messages.append(await channel.unary_unary(case.method)(case.request, metadata=case.metadata,
                                                                           timeout=CALL_TIMEOUT_S))
    except grpc.aio.AioRpcError as error:
        outcome.code, outcome.details = error.code(), error.details() or ""
    return outcome


async def _read_stream(channel: grpc.aio.Channel, case: GrpcCase, outcome: GrpcOutcome) -> None:
    stream = channel.unary_stream(case.method)(case.request, metadata=case.metadata, timeout=CALL_TIMEOUT_S)

    async def read_all() -> None:
        async for message in stream:
            outcome.messages.append(message)

    try:
        await asyncio.wait_for(read_all(), STREAM_READ_S)
    except asyncio.TimeoutError:
        stream.cancel()  # a watch of a job that is still queued: the client goes away
        outcome.code = grpc.StatusCode.CANCELLED


def judge(outcome: GrpcOutcome, methods: Methods) -> list[str]:
    problems = []
    if outcome.code in FORBIDDEN:
        problems.append(f"status {outcome.code.name}")
    if EXCEPTION_NAME.search(outcome.details):
        problems.append(f"a status message naming an exception: {outcome.details[:200]!r}")
    if outcome.code == grpc.StatusCode.OK and methods.is_streaming(outcome.case.method):
        problems += _judge_stream_end(outcome, methods)
    if outcome.case.expect is not None and outcome.code.name != outcome.case.expect:
        problems.append(f"status {outcome.code.name}, expected {outcome.case.expect}")
    return problems


def _judge_stream_end(outcome: GrpcOutcome, methods: Methods) -> list[str]:
    if not outcome.messages:
        return ["a stream that ended OK without its last message"]
    last = methods.response_class(outcome.case.method).FromString(outcome.messages[-1])
    if last.WhichOneof("event") != "finished":
        return ["a stream that ended OK without its last message"]
    return []


# -- schema-guided mutations -------------------------------------------------------------------------------
def scalar(field_descriptor: descriptor.FieldDescriptor) -> st.SearchStrategy[Any]:
    t = field_descriptor.type
    if t == descriptor.FieldDescriptor.TYPE_STRING:
        return st.one_of(st.sampled_from(STRINGS), st.text(max_size=20))
    if t == descriptor.FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == descriptor.FieldDescriptor.TYPE_DOUBLE:
        return st.one_of(st.sampled_from(DOUBLES), st.floats(-3, 3))
    if t == descriptor.FieldDescriptor.TYPE_ENUM:
        return st.sampled_from((0, 1, 2, 3, 4, 5, 6, 99, -1))
    if t == descriptor.FieldDescriptor.TYPE_UINT64:
        return st.sampled_from(UINT64S)
    if t == descriptor.FieldDescriptor.TYPE_UINT32:
        return st.sampled_from(UINTS)
    return st.sampled_from(SINTS)


@st.composite
def fill(draw: Draw, message: Any, depth: int = 0) -> Any:
    """Set a few fields of `message` (recursively) to values of their type."""
    fields = list(message.DESCRIPTOR.fields)
    for f in draw(st.lists(st.sampled_from(fields), max_size=4)) if fields else ():
        if f.type == descriptor.FieldDescriptor.TYPE_MESSAGE:
            if depth < 3:
                target = getattr(message, f.name).add() if _is_repeated(f) else getattr(message, f.name)
                draw(fill(target, depth + 1))
        elif _is_repeated(f):
            getattr(message, f.name).extend(draw(st.lists(scalar(f), max_size=3)))
        else:
            setattr(message, f.name, draw(scalar(f)))
    return message


def _is_repeated(f: descriptor.FieldDescriptor) -> bool:
    if hasattr(f, "is_repeated"):  # protobuf >= 6 dropped `label`
        return bool(f.is_repeated)
    return bool(f.label == descriptor.FieldDescriptor.LABEL_REPEATED)


@st.composite
def mutated_case(draw: Draw, seed: GrpcCase, methods: Methods, key: str) -> GrpcCase:
    message = methods.message(seed.method)
    if draw(st.booleans()):
        with contextlib.suppress(DecodeError):  # a corrupt seed: start from an empty message
            message.MergeFromString(seed.request)
    request = draw(fill(message)).SerializeToString()
    if draw(st.integers(0, 4)) == 0:
        request = draw(_broken(request))
    metadata = seed.metadata
    if draw(st.integers(0, 6)) == 0:
        metadata = (("authorization", draw(st.sampled_from((f"bearer {key}", "Bearer wrong", "", key)))),)
    return GrpcCase(seed.method, request, metadata, "mutant")


@st.composite
def _broken(draw: Draw, request: bytes) -> bytes:
    operation = draw(st.sampled_from(("truncate", "flip", "append", "random")))
    if operation == "truncate" and request:
        return request[:draw(st.integers(0, len(request) - 1))]
    if operation == "flip" and request:
        at = draw(st.integers(0, len(request) - 1))
        return request[:at] + bytes([request[at] ^ draw(st.integers(1, 255))]) + request[at + 1:]
    if operation == "append":
        return request + draw(st.binary(min_size=1, max_size=6))
    return draw(st.binary(min_size=1, max_size=24))
