"""`dsv41 serve --overlap` (Engine(overlap=True)): the same completions as the engine that waits — greedy and
seeded sampling, a max_tokens end and a stop string (the server aborts the request while its next step is in
flight) — and the steps really overlapped."""

from __future__ import annotations

import httpx
import pytest
from tests.server.conftest import MODEL_NAME

BODIES = [
    {"prompt": "The river ran", "max_tokens": 20, "temperature": 0},
    {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0.9, "top_p": 0.9, "seed": 7},
    {"prompt": "It is a truth", "max_tokens": 30, "temperature": 0, "stop": ["e"]},
]


def _complete(server) -> list[tuple[str, str]]:
    out = []
    with httpx.Client(timeout=60) as client:
        for body in BODIES:
            r = client.post(server.base_url + "/completions", json={"model": MODEL_NAME, **body})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            out.append((choice["text"], choice["finish_reason"]))
    return out


def test_an_overlapping_engine_serves_the_same_completions(start_server):
    plain = start_server(max_batch=4)
    overlapped = start_server(max_batch=4, engine_options={"overlap": True})
    want, got = _complete(plain), _complete(overlapped)
    assert got == want
    assert {reason for _, reason in want} == {"length", "stop"}
    assert overlapped.scheduler.engine.stats.overlapped_steps > 20
    assert plain.scheduler.engine.stats.overlapped_steps == 0


def test_the_overlap_flag_parses_on_off_and_unset():
    from dsv41.cli import build_parser

    parse = lambda *flags: build_parser().parse_args(["serve", "--preset", "tiny", *flags]).overlap  # noqa: E731
    assert parse() is None and parse("--overlap") is True and parse("--no-overlap") is False


@pytest.mark.parametrize("argv", [
    ["serve", "--idle-prefill-chunk", "-1"],
    ["serve", "--prefill-chunk", "0"],
    ["generate", "--prompt", "hi", "--idle-prefill-chunk", "-2"],
])
def test_bad_prefill_chunks_exit_2_in_one_line(argv, capsys):
    from dsv41.cli import main

    code = main([*argv, "--preset", "tiny", "--random-init", "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and "chunk" in err and "Traceback" not in err, err


def test_the_warm_up_flag_parses_on_off_and_unset():
    """`serve --warm-up / --no-warm-up` (Engine.warm_up before serving; unset: on with CUDA)."""
    from dsv41.cli import build_parser

    parse = lambda *flags: build_parser().parse_args(["serve", "--preset", "tiny", *flags]).warm_up  # noqa: E731
    assert parse() is None and parse("--warm-up") is True and parse("--no-warm-up") is False


def test_a_server_with_static_prefill_serves_the_same_completions(start_server):
    """`serve --static-prefill` (whole prefill runs from static steps; eager on the CPU): the completions of the
    host-driven prefill, and the static path really ran."""
    plain = start_server(max_batch=4, engine_options={"static_prefill": False})
    static = start_server(max_batch=4, engine_options={"static_prefill": True})
    assert _complete(static) == _complete(plain)
    assert static.scheduler.engine.stats.static_prefill_runs >= len(BODIES)
    assert plain.scheduler.engine.stats.static_prefill_runs == 0


@pytest.mark.parametrize("command", [["serve"], ["generate", "--prompt", "hi"]])
def test_the_static_prefill_flag_parses_on_off_and_unset(command):
    from dsv41.cli import build_parser

    parse = lambda *flags: build_parser().parse_args([*command, "--preset", "tiny", *flags]).static_prefill  # noqa: E731
    assert parse() is None and parse("--static-prefill") is True and parse("--no-static-prefill") is False
