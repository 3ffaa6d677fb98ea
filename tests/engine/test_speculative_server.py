"""Speculative decoding at the edges: `dsv41 generate --speculative` (a clear exit 2 without a drafter, the
acceptance statistics with -v) and a server whose engine speculates streams the plain server's tokens."""

from __future__ import annotations

import json
import urllib.request

import torch

from dsv41.cli import main
from dsv41.engine.cli import load_model_and_tokenizer
from dsv41.engine.speculative import OracleDrafter, StepTimeCurve
from dsv41.server.cli import build_server


def test_generate_speculative_dspark_without_a_drafter_is_a_clear_error(capsys):
    code = main(["generate", "--preset", "tiny", "--random-init", "--device", "cpu", "--prompt", "hi",
                 "--speculative", "dspark"])
    err = capsys.readouterr().err
    assert code == 2 and "no DSpark drafter" in err and "Traceback" not in err, err
    code = main(["generate", "--preset", "tiny", "--random-init", "--device", "cpu", "--prompt", "hi",
                 "--speculative", "oracle", "--draft-tokens", "0"])
    assert code == 2 and "--draft-tokens" in capsys.readouterr().err


def test_generate_speculative_oracle_prints_the_plain_text_and_the_acceptance(capsys):
    torch.set_num_threads(1)
    argv = ["generate", "--preset", "tiny", "--random-init", "--device", "cpu", "--prompt", "Once upon a time",
            "--max-tokens", "6"]
    assert main(argv) == 0
    plain = capsys.readouterr().out
    assert main(argv + ["--speculative", "oracle", "--draft-tokens", "3", "-v"]) == 0
    out = capsys.readouterr()
    assert out.out == plain
    assert "speculative:" in out.err and "tokens/verification" in out.err and "histogram" in out.err, out.err


def test_a_speculating_server_streams_the_plain_servers_greedy_tokens():
    from tests.server.conftest import MODEL_NAME, TINY_ARGS, LiveServer

    torch.set_num_threads(1)
    model, tok = load_model_and_tokenizer(TINY_ARGS)
    drafter = OracleDrafter(model, 3, max_sequences=2, max_seq_len=model.config.max_seq_len)
    servers = [LiveServer(*build_server(model, tok, model_name=MODEL_NAME, max_batch=2, kv_budget_bytes=2**27,
                                        engine_options=options))
               for options in ({}, {"drafter": drafter, "step_time": StepTimeCurve([(1, 1.0)])})]
    try:
        texts = []
        for server in servers:
            body = json.dumps({"model": MODEL_NAME, "prompt": "It was a dark and stormy night", "max_tokens": 6,
                               "temperature": 0}).encode()
            req = urllib.request.Request(server.base_url + "/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as resp:
                texts.append(json.loads(resp.read())["choices"][0]["text"])
        assert texts[0] == texts[1] and texts[0], texts
        st = servers[1].scheduler.engine.stats.speculative
        assert st.verifications > 0 and st.accepted == st.drafted, st.summary()
    finally:
        for server in servers:
            server.close()
