"""`moecache bench-serve`: the figures of hand-made streams, and the command end to end on the embedded model
(a real server process, HTTP and gRPC streams, the in-process engine). A smoke test, not a timing test."""

from __future__ import annotations

import contextlib
import io
import json
from typing import Any

import pytest

from service.bench.serving import ServerSide, gaps_within, median_run, served_figures, server_side
from service.bench.streams import Run, StreamTiming
from service.cli import main

CLIENTS, GEN_LEN, JOINING = (1, 3), 6, 2


def stream(start: float, arrivals: list[float], chunk_tokens: list[int] | None = None) -> StreamTiming:
    tokens = chunk_tokens or [1] * len(arrivals)
    return StreamTiming(start, tuple(arrivals), tuple(tokens), sum(tokens))


def test_decode_speed_counts_tokens_from_the_moment_every_stream_decodes() -> None:
    # the second stream's first token comes at 2.0: from then on 2 + 3 tokens in 1.0 s
    run = Run((stream(0.0, [1.0, 1.5, 2.5, 3.0]), stream(0.0, [2.0, 2.5, 2.75, 3.0])), (), 0.0, 3.0)
    figures = served_figures("http", run)
    assert figures.tokens == 8 and figures.tokens_per_second == pytest.approx(8 / 3)
    assert figures.decode_tokens_per_second == pytest.approx(5.0)
    assert figures.ttft.p50_ms == pytest.approx(1500.0) and figures.ttft.count == 2
    assert figures.itl.count == 6 and figures.itl_joining is None


def test_a_chunk_of_several_tokens_counts_its_gap_per_token() -> None:
    timing = stream(0.0, [1.0, 2.0, 2.5], [1, 4, 1])
    assert timing.gaps == [0.25, 0.5]
    assert timing.tokens_after(1.0) == 5


def test_latency_while_prompts_join_takes_the_gaps_inside_the_join_window() -> None:
    running = stream(0.0, [1.0, 2.0, 3.0, 4.0, 5.0])
    joined = stream(2.5, [3.5])
    run = Run((running,), (joined,), 0.0, 5.0)
    assert run.join_window == (2.5, 3.5)
    assert gaps_within([running], (2.5, 3.5)) == [1.0]
    figures = served_figures("grpc", run)
    assert figures.itl_joining is not None and figures.itl_joining.count == 1
    assert figures.ttft_joining is not None and figures.ttft_joining.p50_ms == pytest.approx(1000.0)


def test_the_servers_view_of_a_run_is_the_mean_of_what_its_histograms_added() -> None:
    queue, ttft = "moecache_request_queue_time_seconds", "moecache_time_to_first_token_seconds"
    before = {f"{queue}_sum": 1.0, f"{queue}_count": 2, f"{ttft}_sum": 3.0, f"{ttft}_count": 2}
    after = {f"{queue}_sum": 1.3, f"{queue}_count": 5, f"{ttft}_sum": 3.9, f"{ttft}_count": 5}
    side = server_side(before, after)
    assert side is not None and side.queue_ms == pytest.approx(100.0) and side.ttft_ms == pytest.approx(300.0)
    assert server_side(None, after) is None and server_side(before, before) is None
    assert ServerSide(1.25, 2.5).cell() == "1.2 / 2.5"


def test_the_median_run_is_reported_whole() -> None:
    runs = [served_figures("http", Run((stream(0.0, [1.0, 1.0 + d]),), (), 0.0, 1.0 + d)) for d in (0.1, 0.4, 0.2)]
    assert median_run(runs).decode_tokens_per_second == pytest.approx(1 / 0.2)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    path = tmp_path_factory.mktemp("bench-serve") / "serve.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["bench-serve", "--device", "cpu", "--clients", ",".join(map(str, CLIENTS)),
                     "--gen-len", str(GEN_LEN), "--repeats", "1", "--join", str(JOINING), "--join-prompt-len", "40",
                     "--max-num-seqs", "8", "--json", str(path)])
    assert code == 0
    return out.getvalue(), json.loads(path.read_text())


def test_every_client_of_every_path_gets_its_tokens(report: tuple[str, dict[str, Any]]) -> None:
    _, doc = report
    rows = {(row["path"], row["clients"]): row for row in doc["served"]}
    assert set(rows) == {(path, n) for path in ("http", "grpc") for n in CLIENTS}
    for (_, clients), row in rows.items():
        assert row["tokens"] == clients * GEN_LEN
        assert row["ttft"]["count"] == clients and row["ttft_joining"]["count"] == JOINING
        assert row["itl"]["count"] >= clients  # every stream sent several chunks


def test_figures_are_positive_and_beside_the_engine(report: tuple[str, dict[str, Any]]) -> None:
    table, doc = report
    assert [e["batch"] for e in doc["engine"]] == list(CLIENTS)
    for row in doc["served"]:
        assert row["tokens_per_second"] > 0 and row["decode_tokens_per_second"] > 0 and row["engine_ratio"] > 0
        assert 0 < row["ttft"]["p50_ms"] <= row["ttft"]["p99_ms"] and 0 < row["itl"]["p50_ms"] <= row["itl"]["p99_ms"]
        # the server's own view of the same run: arrival -> first step -> first token, inside the clients' TTFT
        server = row["server"]
        assert 0 <= server["queue_ms"] <= server["ttft_ms"] <= row["ttft"]["p99_ms"], row
    assert all(e["decode_tokens_per_second"] > 0 and e["tokens_per_second"] > 0 for e in doc["engine"])
    assert doc["settings"]["prompt_tokens"] > 0 and doc["machine"]["device"] == "cpu"
    assert doc["settings"]["same_prompt"] is False and "a prompt of its own for each stream" in table
    assert table.count("| http |") == len(CLIENTS) and table.count("| engine (in process) |") == len(CLIENTS)


def test_a_missing_grpc_target_is_refused_before_anything_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench-serve", "--device", "cpu", "--url", "http://127.0.0.1:9"]) == 2
    assert "--grpc-target" in capsys.readouterr().err


def test_the_default_sequence_count_grows_to_every_stream_and_joining_request(capsys: pytest.CaptureFixture[str]) \
        -> None:
    from service.cli import parse
    from service.commands.bench_serve import check_batches, fit_sequences
    from service.options import engine_config

    args = parse(["bench-serve", "--device", "cpu", "--clients", "1,8,32", "--join", "4"])
    fit_sequences(args)
    assert args.max_num_seqs == 36 and "--max-num-seqs 36" in capsys.readouterr().err
    check_batches(args, engine_config(args))  # no longer refused
    given = parse(["bench-serve", "--device", "cpu", "--clients", "32", "--join", "4", "--max-num-seqs", "16"])
    fit_sequences(given)
    assert given.max_num_seqs == 16
    with pytest.raises(ValueError, match="need --max-num-seqs 36"):
        check_batches(given, engine_config(given))


def test_each_stream_sends_a_prompt_of_its_own_unless_told_otherwise() -> None:
    from service.cli import parse
    from service.commands.bench_serve import stream_loads

    loads = stream_loads(parse(["bench-serve", "--clients", "1,3", "--prompt", "Hi", "--gen-len", "5"]))
    assert [(load.prompt, load.max_tokens) for load in loads] == [("Hi (1)", 5), ("Hi (2)", 5), ("Hi (3)", 5)]
    same = stream_loads(parse(["bench-serve", "--clients", "2", "--prompt", "Hi", "--same-prompt"]))
    assert [load.prompt for load in same] == ["Hi", "Hi"]


def test_the_engine_beside_the_server_decodes_the_streams_prompts_in_turn() -> None:
    from service.bench.runner import GivenPrompts

    prompts = GivenPrompts([(1, 2), (3,)])
    taken = [prompts.next(16) for _ in range(3)]
    assert [ids for _, ids in taken] == [(1, 2), (3,), (1, 2)]
    assert len({request_id for request_id, _ in taken}) == 3
