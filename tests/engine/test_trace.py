"""Routing traces: checked ids, the file format, and the recorders (one stream, one stream per request)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.trace import RequestTraces, RoutingTrace, TraceError, TraceRecorder


def test_trace_checks_its_ids() -> None:
    with pytest.raises(ValueError, match="num_tokens, num_layers, top_k"):
        RoutingTrace(np.zeros((2, 3)), 8, "t")
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        RoutingTrace(np.array([[[1, 8]]]), 8, "t")
    with pytest.raises(ValueError, match="distinct"):
        RoutingTrace(np.array([[[3, 3]]]), 8, "t")
    with pytest.raises(ValueError, match="integers"):
        RoutingTrace(np.array([[[1.0, 2.0]]]), 8, "t")
    with pytest.raises(ValueError, match="layers"):
        RoutingTrace(np.array([[[1, 2]]]), 8, "t", layers=(0, 1))


def test_trace_is_int16_and_read_only() -> None:
    trace = RoutingTrace(np.array([[[1, 2], [3, 4]]]), 8, "t")
    assert trace.expert_ids.dtype == np.int16 and not trace.expert_ids.flags.writeable
    assert (trace.num_tokens, trace.num_layers, trace.top_k, trace.layers) == (1, 2, 2, (0, 1))


def test_trace_save_load_round_trip(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    ids = np.array([[rng.permutation(8)[:2] for _ in range(4)] for _ in range(50)])  # [tokens, layers, top_k]
    trace = RoutingTrace(ids, 8, "hand-made", layers=(1, 2, 3, 4))
    path = tmp_path / "trace.npz"
    trace.save(path)
    loaded = RoutingTrace.load(path)
    assert np.array_equal(loaded.expert_ids, trace.expert_ids)
    assert (loaded.num_experts, loaded.source, loaded.layers) == (8, "hand-made", (1, 2, 3, 4))


def test_trace_load_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no such file"):
        RoutingTrace.load(tmp_path / "absent.npz")
    text = tmp_path / "text.npz"
    text.write_text("not a trace")
    with pytest.raises(TraceError, match="not a .npz routing trace"):
        RoutingTrace.load(text)
    single = tmp_path / "single.npy"
    np.save(single, np.zeros(3))
    with pytest.raises(TraceError, match="a single array"):
        RoutingTrace.load(single)
    partial = tmp_path / "partial.npz"
    with open(partial, "wb") as f:
        np.savez(f, expert_ids=np.zeros((1, 1, 1), np.int16))
    with pytest.raises(TraceError, match="missing format_version, num_experts"):
        RoutingTrace.load(partial)


def test_trace_load_rejects_other_versions_and_bad_ids(tmp_path: Path) -> None:
    for version, message in ((2, "format version 2"), (1, r"\[0, 8\)")):
        path = tmp_path / f"v{version}.npz"
        with open(path, "wb") as f:
            ids = np.array([[[9]]], np.int16)  # expert 9 of 8
            np.savez(f, format_version=version, expert_ids=ids, num_experts=8, layers=[0], source="x")
        with pytest.raises(TraceError, match=message):
            RoutingTrace.load(path)


def test_recorder_keeps_token_order(tmp_path: Path) -> None:
    recorder = TraceRecorder(num_experts=16, source="engine")
    recorder.add_step(np.array([[[0, 1], [2, 3]], [[4, 5], [6, 7]]]))  # [layers=2, tokens=2, top_k=2]
    recorder.add_step(np.array([[[8, 9]], [[10, 11]]]))
    assert recorder.num_tokens == 3
    recorder.save(tmp_path / "rec.npz")
    trace = RoutingTrace.load(tmp_path / "rec.npz")
    assert trace.expert_ids.tolist() == [[[0, 1], [4, 5]], [[2, 3], [6, 7]], [[8, 9], [10, 11]]]
    assert (trace.num_experts, trace.source) == (16, "engine")


def test_recorder_rejects_mismatched_steps_and_infers_num_experts() -> None:
    recorder = TraceRecorder()
    with pytest.raises(ValueError, match="no steps"):
        recorder.trace()
    recorder.add_step(np.array([[[0, 5]]]))
    with pytest.raises(ValueError, match="does not match"):
        recorder.add_step(np.array([[[0, 1, 2]]]))
    assert recorder.trace().num_experts == 6


def test_request_traces_keep_each_request_a_stream(tmp_path: Path) -> None:
    traces = RequestTraces(num_experts=8, layers=(1, 2), top_k=2)
    # step 1: a's two prompt tokens, then b's one; step 2: one token each, b first
    traces.add_step([("a", 2), ("b", 1)], np.array([[0, 1, 2, 3, 4, 5], [6, 7, 0, 1, 2, 3]]))
    traces.add_step([("b", 1), ("a", 1)], np.array([[1, 2, 3, 4], [5, 6, 7, 0]]))
    traces.save(tmp_path / "t.npz")
    trace = RoutingTrace.load(tmp_path / "t.npz")
    a = [[[0, 1], [6, 7]], [[2, 3], [0, 1]], [[3, 4], [7, 0]]]
    b = [[[4, 5], [2, 3]], [[1, 2], [5, 6]]]
    assert trace.expert_ids.tolist() == a + b and trace.layers == (1, 2)
