"""Traffic capture (trtspec.capture): sampling, rotation and the size cap, the request path kept off the disk, and
the client's `store` false honoured. The served path is in test_lifecycle.py."""

from __future__ import annotations

import json
import stat
import sys
import threading
import time

import pytest

from trtspec.capture import (
    Capture,
    CaptureError,
    CaptureSettings,
    capture_files,
    make_record,
    read_records,
    split_heldout,
)


def _record(i: int, width: int = 8) -> dict:
    return make_record(
        model="tensorrt_llm_bls",
        route="chat" if i % 2 else "translate",
        input_ids=list(range(1, width + 1)),
        output_ids=[i % 300 + 1] * width,
        text_input=f"prompt {i}",
        text_output=f"answer {i}",
        temperature=0.0,
        num_draft_tokens=4,
        num_accepted_tokens=2,
    )


def _wait_written(capture: Capture, count: int, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while capture.written + capture.dropped < count and time.monotonic() < end:
        time.sleep(0.01)
    assert capture.written + capture.dropped >= count


def test_sampling_rate_is_the_share_captured(tmp_path):
    capture = Capture(CaptureSettings(str(tmp_path), rate=0.1), seed=7)
    queued = sum(capture.offer(_record(i)) for i in range(3000))
    capture.close()
    # binomial(3000, 0.1): sd 16.4, so 300 +- 82 is five standard deviations
    assert 218 <= queued <= 382, queued
    assert len(read_records(tmp_path)) == queued == capture.written
    off = Capture(CaptureSettings(str(tmp_path / "none"), rate=0.0), seed=7)
    assert not any(off.offer(_record(i)) for i in range(500))
    off.close()
    assert capture_files(tmp_path / "none") == []


def test_files_rotate_and_the_cap_deletes_the_oldest(tmp_path):
    line = len(json.dumps(_record(0))) + 40
    settings = CaptureSettings(str(tmp_path), rate=1.0, max_bytes=20 * line, file_bytes=5 * line)
    capture = Capture(settings, seed=0)
    for i in range(200):
        assert capture.offer(_record(i))
        _wait_written(capture, i + 1)  # one at a time: the queue never overflows here
    capture.close()
    files = capture_files(tmp_path)
    sizes = [p.stat().st_size for p in files]
    assert len(files) >= 3 and all(size <= settings.rotate_at for size in sizes), sizes
    assert sum(sizes) <= settings.max_bytes
    assert capture.deleted > 0
    kept = read_records(tmp_path)
    assert kept and kept[-1]["text_input"] == "prompt 199"  # the newest survive, the oldest went
    assert kept[0]["text_input"] != "prompt 0"
    # user data: the files are the server user's alone
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files)


def test_no_record_waits_on_the_disk(tmp_path):
    """The writer is stalled in its open() of the capture file (an audit hook holds it there, as a hung disk would):
    offers still return at once, without a file operation on the calling thread; the queue's overflow is dropped and
    counted; once the disk answers, what was queued is written."""
    stall = threading.Event()
    stalled = threading.Event()
    events: list[tuple[int, str]] = []
    active = [True]

    def hook(event, args):
        if not active[0] or event not in ("open", "os.rename", "os.remove", "os.mkdir"):
            return
        if event == "open" and str(args[0]).startswith(str(tmp_path / "capture-")):
            events.append((threading.get_ident(), event))
            if threading.current_thread().name == "trtspec-capture" and not stall.is_set():
                stalled.set()
                stall.wait(60)
        elif str(args[0]).startswith(str(tmp_path)):
            events.append((threading.get_ident(), event))

    sys.addaudithook(hook)
    try:
        capture = Capture(CaptureSettings(str(tmp_path), rate=1.0), seed=0)
        events.clear()
        capture.offer(_record(0))
        assert stalled.wait(30)
        main = threading.get_ident()
        results = [capture.offer(_record(i)) for i in range(1, 1000)]
        assert not [e for e in events if e[0] == main]
        assert capture.dropped > 0 and results.count(True) + capture.dropped == 999
        stall.set()
        capture.close(timeout=60)
        assert capture.written == 1 + results.count(True)
    finally:
        active[0] = False
        stall.set()
    assert len(read_records(tmp_path)) == capture.written


def test_the_client_asking_for_no_retention_is_never_captured(tmp_path):
    capture = Capture(CaptureSettings(str(tmp_path), rate=1.0), seed=0)
    assert not any(capture.offer(_record(i), store=False) for i in range(100))
    assert capture.offer(_record(100), store=True) and capture.offer(_record(101))
    capture.close()
    assert [r["text_input"] for r in read_records(tmp_path)] == ["prompt 100", "prompt 101"]


def test_settings_and_records_are_checked(tmp_path):
    with pytest.raises(CaptureError, match="--capture-rate"):
        CaptureSettings(str(tmp_path), rate=1.5)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CaptureError, match="is a file"):
        Capture(CaptureSettings(str(tmp_path / "file")))
    with pytest.raises(CaptureError, match="holds no capture-"):
        read_records(tmp_path)
    bad = tmp_path / "capture-1.jsonl"
    bad.write_text('{"prompt": "hi"}\n')
    with pytest.raises(CaptureError, match="line 1: not a captured request"):
        read_records(tmp_path)
    # a last line cut short by a crash is skipped
    bad.write_text(json.dumps(_record(1)) + "\n" + json.dumps(_record(2))[:30])
    assert len(read_records(tmp_path)) == 1
    settings = CaptureSettings(str(tmp_path), rate=0.25, max_bytes=1 << 20)
    assert CaptureSettings.from_env({"TRTSPEC_CAPTURE": settings.to_env()}) == settings


def test_heldout_split_prefers_greedy_records():
    records = [dict(_record(i), greedy=i % 3 == 0) for i in range(90)]
    train, held = split_heldout(records, 0.1, seed=1)
    assert len(held) == 9 and len(train) == 81
    assert all(r["greedy"] for r in held)
    assert split_heldout(records, 0.1, seed=1)[1] == held


def test_the_writer_decodes_the_text_a_record_lacks(tmp_path):
    capture = Capture(CaptureSettings(str(tmp_path), rate=1.0), seed=0, decode=lambda ids: " ".join(map(str, ids)))
    record = make_record(
        model="m",
        route=None,
        input_ids=[1, 2],
        output_ids=[3],
        temperature=0.0,
        num_draft_tokens=0,
        num_accepted_tokens=0,
    )
    capture.offer(record)
    capture.close()
    (kept,) = read_records(tmp_path)
    assert (kept["text_input"], kept["text_output"], kept["greedy"]) == ("1 2", "3", True)


def test_the_openai_front_passes_store_false_to_the_bls():
    from trtspec.openai_api.errors import APIError
    from trtspec.openai_api.protocol import CHAT, parse_request

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert parse_request(body | {"store": False}, CHAT).generate_kwargs()["store"] is False
    assert parse_request(body, CHAT).generate_kwargs()["store"] is None  # left out: the deployment's setting
    with pytest.raises(APIError, match="store"):
        parse_request(body | {"store": "no"}, CHAT)
