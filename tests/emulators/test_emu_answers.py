"""The search and reward emulators' answers on a real server: Search-R1's wire format, documents, sizes, BM25 retrieval over a corpus."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from emu_support import FAST, FAULT, INJECTED, TIMER, start_server
from testkit import ServerProcess, free_port

from toolenv_core.latency import load_profile
from toolenv_core.latency.profile import shipped_profile_path


def tokens(result: list[dict]) -> int:
    return sum(len(d["contents"].split()) for d in result)


def test_retrieve_is_search_r1_wire_compatible(client: httpx.Client) -> None:
    client.put("/v1/emulators/search/profile", json=FAST)
    r = client.post("/retrieve", json={"queries": ["who wrote hamlet", "capital of peru"]})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    result = r.json()["result"]
    assert len(result) == 2 and all(len(docs) == 3 for docs in result)  # topk defaults to 3
    for doc in result[0]:
        assert set(doc) == {"id", "contents"}
        title, body = doc["contents"].split("\n", 1)
        assert title.startswith('"') and title.endswith('"') and body
    scored = client.post(
        "/retrieve", json={"queries": ["who wrote hamlet"], "topk": 5, "return_scores": True}
    ).json()
    items = scored["result"][0]
    assert len(items) == 5 and all(set(i) == {"document", "score"} for i in items)
    assert [i["score"] for i in items] == sorted((i["score"] for i in items), reverse=True)
    assert float(r.headers[INJECTED]) == 0.0 and TIMER in r.headers


def test_results_are_deterministic_per_seed_and_query(
    client: httpx.Client, server: ServerProcess
) -> None:
    client.put("/v1/emulators/search/profile", json=FAST)
    body = {"queries": ["a query", "another one"], "topk": 4}
    first = client.post("/retrieve", json=body).content
    assert client.post("/retrieve", json=body).content == first
    other_query = client.post(
        "/retrieve", json={"queries": ["a different query"], "topk": 4}
    ).json()["result"][0]
    assert other_query != json.loads(first)["result"][0]
    assert (
        json.loads(first)["result"][1]
        == client.post("/retrieve", json={"queries": ["another one"], "topk": 4}).json()["result"][
            0
        ]
    )
    native = client.post("/v1/emulators/search/call", json={"query": "a query", "topk": 4}).json()
    assert native["result"][0] == json.loads(first)["result"][0] and native["tool"] == "search"
    assert native["topk"] == 4 and len(native["response_tokens"]) == 1


def test_response_token_sizes_follow_the_trace(client: httpx.Client) -> None:
    client.put(
        "/v1/emulators/search/profile",
        json={
            **FAST,
            "response_tokens": load_profile(
                shipped_profile_path("search_default")
            ).response_tokens.model_dump(),
        },
    )
    sizes = [
        tokens(
            client.post("/retrieve", json={"queries": [f"question number {i}"]}).json()["result"][0]
        )
        for i in range(150)
    ]
    assert 470 < np.mean(sizes) < 540  # PolyTrace search_r1: ~505 tokens per top-3 query
    assert np.std(sizes) > 10  # drawn, not constant
    five = [
        tokens(
            client.post("/retrieve", json={"queries": [f"question number {i}"], "topk": 6}).json()[
                "result"
            ][0]
        )
        for i in range(40)
    ]
    assert 1.8 < np.mean(five) / np.mean(sizes[:40]) < 2.2  # scales with topk
    exact = client.post(
        "/v1/emulators/search/call", json={"queries": ["x", "y"], "response_tokens": 301}
    ).json()
    assert exact["response_tokens"] == [151, 150]
    assert [tokens(r) for r in exact["result"]] == [151, 150]


def test_reward_emulator_scales_with_batch_size(client: httpx.Client) -> None:
    assert (
        client.put(
            "/v1/emulators/reward/profile",
            json={"model": {"kind": "constant", "value_s": 0.1}, "reference": {"batch_size": 64}},
        ).status_code
        == 200
    )
    r = client.post("/v1/emulators/reward/call", json={"batch_size": 128})
    assert r.status_code == 200 and r.headers[INJECTED] == "200.000"
    assert r.json() == {"tool": "reward", "batch_size": 128, "scale": 2.0, "reward_time_s": 0.2}
    lengths = client.post("/v1/emulators/reward/call", json={"response_lengths": [100] * 32})
    assert lengths.json()["batch_size"] == 32 and lengths.headers[INJECTED] == "50.000"
    exact = client.post("/v1/emulators/reward/call", json={"batch_size": 5, "delay_s": 0.02})
    assert exact.headers[INJECTED] == "20.000"


def test_real_bm25_retrieval_over_a_corpus(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    docs = [
        {
            "id": "d1",
            "title": "Hamlet",
            "text": "Hamlet is a tragedy written by William Shakespeare.",
        },
        {"id": "d2", "contents": '"Lima"\nLima is the capital and largest city of Peru.'},
        {"id": "d3", "title": "Photosynthesis", "text": "Plants turn light into chemical energy."},
    ]
    corpus.write_text("\n".join(json.dumps(d) for d in docs) + "\n")
    s = start_server("--corpus", str(corpus))
    try:
        with httpx.Client(base_url=s.url, timeout=30) as c:
            c.put(
                "/v1/emulators/search/profile", json={"model": {"kind": "constant", "value_s": 0.1}}
            ).raise_for_status()
            r = c.post(
                "/retrieve",
                json={
                    "queries": ["who wrote hamlet shakespeare", "capital of peru"],
                    "topk": 2,
                    "return_scores": True,
                },
            )
            assert r.status_code == 200
            first, second = r.json()["result"]
            assert first[0]["document"]["id"] == "d1" and second[0]["document"]["id"] == "d2"
            assert first[0]["document"]["contents"].startswith('"Hamlet"\n')
            assert float(r.headers[INJECTED]) >= 100.0  # delay = max(real, sampled)
            # a slow body is the same answer, trickled: it was made of synthetic documents
            slow = [{"type": "slow_body", "rate": 1.0, "duration_s": 0.05, "chunks": 2}]
            faulty = {"kind": "faulty", "model": FAST["model"], "faults": slow}
            c.put("/v1/emulators/search/profile", json={"model": faulty}).raise_for_status()
            r = c.post("/retrieve", json={"queries": ["capital of peru"], "topk": 1})
            assert r.headers[FAULT] == "slow_body"
            assert r.json() == {"result": [[docs[1]]]}
    finally:
        s.stop()


@pytest.mark.parametrize(
    ("lines", "problem"),
    [
        ('{"id": "d1", "contents": "ok"}\nnot json\n', "corpus.jsonl:2: not valid JSON"),
        ('{"id": "d1"}\n', "corpus.jsonl:1: field 'contents': each line needs `contents` or"),
        ("[1]\n", "corpus.jsonl:1: expected a JSON object"),
        ("\n", "corpus.jsonl: the corpus is empty"),
        # nothing for BM25 to index: it failed inside bm25s at start-up (a traceback, exit 3)
        (
            '{"id": "d1", "title": "", "text": "the of a"}\n',
            "corpus.jsonl: none of its 1 document(s) has a word BM25 indexes",
        ),
    ],
)
def test_a_bad_corpus_is_one_line_and_exit_2(tmp_path: Path, lines: str, problem: str) -> None:
    # it was read inside uvicorn's start-up: a traceback and exit 3
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(lines)
    out = subprocess.run(
        [sys.executable, "-m", "toolenv", "emulators", "serve", "--port", str(free_port()),
         "--corpus", str(corpus)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith(f"error: invalid emulators settings: corpus: {tmp_path}/{problem}")
    assert out.stderr.count("\n") == 1, out.stderr


def test_a_default_topk_above_max_topk_is_refused_at_start() -> None:
    # it was accepted: every /retrieve without topk was a 422 about a topk nobody sent
    env = {**os.environ, "TOOLENV_EMULATORS_DEFAULT_TOPK": "60"}
    out = subprocess.run(
        [sys.executable, "-m", "toolenv", "emulators", "serve", "--port", str(free_port())],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert out.stderr == (
        "error: invalid emulators settings: default_topk (60) exceeds max_topk (50)\n"
    )


def test_documents_are_the_same_in_any_process_for_a_seed(client: httpx.Client) -> None:
    from emulators.search.documents import synthetic_results

    client.put("/v1/emulators/search/profile", json=FAST)
    served = client.post(
        "/v1/emulators/search/call",
        json={"query": "cross process", "response_tokens": 500, "return_scores": True},
    ).json()
    assert served["result"][0] == synthetic_results(
        7, "cross process", 3, 500
    )  # the server runs --seed 7
    assert served["result"][0] != synthetic_results(8, "cross process", 3, 500)
