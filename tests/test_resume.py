"""What a stream delivered and the request that continues it (gateway/resume.py)."""

from __future__ import annotations

import json
import tracemalloc

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.gateway import resume
from proxy.gateway.resume import GrpcTranscript, SseTranscript, resume_body, resume_generate
from proxy.pb.unitproxy.v1 import inference_pb2
from proxy.resume import HintKey, parse_hint

KEY = HintKey("test-secret")


def unsigned(value: str, delivered: str | list[int]) -> dict[str, int]:
    """The hint's counts, once its signature is checked for ``delivered``."""
    hint = parse_hint(value)
    assert hint is not None and KEY.valid(hint, delivered)
    assert not HintKey("another-secret").valid(hint, delivered)
    raw: dict[str, int] = json.loads(value)
    del raw["sig"]
    return raw


def chat_event(content: str | None, *, role: bool = False, finish: str | None = None) -> bytes:
    delta: dict[str, object] = {"content": content}
    if role:
        delta["role"] = "assistant"
    chunk = {"id": "chatcmpl-1", "created": 1700000000, "object": "chat.completion.chunk",
             "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}  # fmt: skip
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def test_the_transcript_reads_text_created_and_the_end() -> None:
    t = SseTranscript()
    t.add(chat_event("", role=True) + chat_event("Hello"))
    t.add(chat_event(" world"))
    assert (t.text(), t.created, t.finished, t.resumable) == (
        "Hello world",
        1700000000,
        False,
        True,
    )
    t.add(chat_event(None, finish="stop") + b"data: [DONE]\n\n")
    assert t.text() == "Hello world" and t.finished and t.done


def test_a_long_stream_is_kept_folded() -> None:
    t = SseTranscript()
    for i in range(5000):
        t.add(chat_event(f" w{i}"))
        assert t.kept_bytes <= resume.FOLD_AT + 5000 * 8
    assert t.text() == "".join(f" w{i}" for i in range(5000))


def test_tool_calls_and_several_choices_cannot_be_resumed() -> None:
    t = SseTranscript()
    chunk = {"created": 1, "choices": [{"index": 0, "delta": {"tool_calls": [{"id": "x"}]}}]}
    t.add(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    t.text()
    assert not t.resumable
    t = SseTranscript()
    t.add(b'data: {"created": 1, "choices": [{"index": 1, "text": "a"}]}\n\n')
    t.text()
    assert not t.resumable


def test_a_completion_resumes_with_its_text_appended() -> None:
    body = json.dumps({"prompt": "Once", "max_tokens": 9, "stream": True}).encode()
    out = json.loads(resume_body("completions", body, " upon"))
    assert out == {"prompt": "Once upon", "max_tokens": 9, "stream": True}
    batch = json.dumps({"prompt": ["Once"], "stream": True}).encode()
    assert json.loads(resume_body("completions", batch, " upon"))["prompt"] == "Once upon"
    ids = json.dumps({"prompt": [1, 2, 3], "stream": True}).encode()
    assert resume_body("completions", ids, " upon") is None
    several = json.dumps({"prompt": "Once", "n": 2, "stream": True}).encode()
    assert resume_body("completions", several, " upon") is None


def test_a_chat_resumes_with_a_partial_assistant_message() -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": True})
    out = json.loads(resume_body("chat", body.encode(), "Hello"))
    assert out["messages"][-1] == {"role": "assistant", "content": "Hello"}
    assert out["continue_final_message"] is True and out["add_generation_prompt"] is False
    # a client that continues its own assistant message: that message grows
    own = json.dumps({"messages": [{"role": "user", "content": "hi"},
                                   {"role": "assistant", "content": "Dear"}],
                      "continue_final_message": True, "add_generation_prompt": False})  # fmt: skip
    out = json.loads(resume_body("chat", own.encode(), " sir"))
    assert out["messages"][-1] == {"role": "assistant", "content": "Dear sir"}
    assert len(out["messages"]) == 2
    assert resume_body("chat", body.encode(), "") == body.encode()
    assert unsigned(resume.resume_hint(KEY, 17, " sir!"), " sir!") == {
        "created": 17,
        "delivered_chars": 5,
    }


def grpc_chunks(*texts: str, ids_from: int = 0) -> list[bytes]:
    return [
        inference_pb2.GenerateChunk(text=t, token_ids=[ids_from + i]).SerializeToString()
        for i, t in enumerate(texts)
    ]


def test_a_grpc_transcripts_usage_is_its_last_chunks_read_alone() -> None:
    t = GrpcTranscript()
    for m in grpc_chunks(" a", " b"):
        t.add(m)
    assert t.last_usage() is None and t.output_tokens() == 2
    last = inference_pb2.GenerateChunk(text=" c", token_ids=[3], finish_reason="stop")
    last.usage.prompt_tokens, last.usage.completion_tokens = 5, 3
    t.add(last.SerializeToString())
    assert t.last_usage() == (5, 3)
    assert t.text() == " a b c"  # the chunks before it still read when asked
    t.add(grpc_chunks(" d")[0])  # a chunk after it without usage: the last that had one
    assert t.last_usage() == (5, 3)


CHUNKS = st.builds(
    inference_pb2.GenerateChunk,
    request_id=st.text(max_size=40),
    text=st.text(max_size=300),
    token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=80),
    finish_reason=st.sampled_from(["", "stop", "length"]),
    usage=st.none()
    | st.builds(
        inference_pb2.Usage,
        prompt_tokens=st.integers(0, 2**32 - 1),
        completion_tokens=st.integers(0, 2**32 - 1),
        total_tokens=st.integers(0, 2**32 - 1),
    ),
    unit_id=st.text(max_size=20),
)


@given(st.lists(CHUNKS, min_size=1, max_size=3))
@settings(max_examples=300, deadline=None)
def test_a_chunks_usage_read_from_the_wire_is_what_a_parse_says(
    chunks: list[inference_pb2.GenerateChunk],
) -> None:
    """resume.chunk_usage (the compiled build's read of a finished stream's usage) says
    what GenerateChunk.FromString does, of one chunk or of several concatenated (one
    message to protobuf, its fields merged)."""
    wire = b"".join(c.SerializeToString() for c in chunks)
    parsed = inference_pb2.GenerateChunk.FromString(wire)
    expected = (
        (parsed.usage.prompt_tokens, parsed.usage.completion_tokens)
        if parsed.HasField("usage")
        else None
    )
    assert resume.chunk_usage(wire) == expected


def test_a_chunk_the_wire_reader_cannot_step_through_is_none() -> None:
    last = inference_pb2.GenerateChunk(text="x")
    last.usage.prompt_tokens = 3
    wire = last.SerializeToString()
    assert resume.chunk_usage(wire) == (3, 0)
    assert resume.chunk_usage(wire[:-1]) is None  # cut inside the usage
    assert resume.chunk_usage(b"\x0b" + wire) is None  # a group's start: not stepped over
    assert resume.chunk_usage(b"\x12\xff") is None  # a length past the end


def test_grpc_requests_resume_by_their_input_kind() -> None:
    t = GrpcTranscript()
    for m in grpc_chunks(" a", " b", ids_from=7):
        t.add(m)
    by_ids = inference_pb2.GenerateRequest(
        request_id="r", prompt_token_ids=inference_pb2.PromptTokenIds(ids=[1, 2])
    )
    out = resume_generate(by_ids.SerializeToString(), t, KEY)
    assert out is not None
    msg = inference_pb2.GenerateRequest.FromString(out[0])
    assert list(msg.prompt_token_ids.ids) == [1, 2, 7, 8]
    assert unsigned(out[1], [7, 8]) == {"delivered_tokens": 2}
    by_text = inference_pb2.GenerateRequest(request_id="r", prompt="Once")
    out = resume_generate(by_text.SerializeToString(), t, KEY)
    assert out is not None
    assert inference_pb2.GenerateRequest.FromString(out[0]).prompt == "Once a b"
    chat = inference_pb2.GenerateRequest(
        chat=inference_pb2.ChatMessages(
            messages=[inference_pb2.ChatMessage(role="user", content="hi")]
        )
    )
    out = resume_generate(chat.SerializeToString(), t, KEY)
    assert out is not None
    resumed = inference_pb2.GenerateRequest.FromString(out[0]).chat
    assert resumed.continue_final_message
    assert (resumed.messages[-1].role, resumed.messages[-1].content) == ("assistant", " a b")
    assert unsigned(out[1], " a b") == {"delivered_chars": 4}


def test_what_a_2000_token_stream_keeps_is_bounded() -> None:
    events = [chat_event(f" tok{i % 100}") for i in range(2000)]
    tracemalloc.start()
    try:
        t = SseTranscript()
        base = tracemalloc.get_traced_memory()[0]
        peak = 0
        for event in events:
            t.add(bytes(bytearray(event)))  # a fresh object, as each read from a unit is
            peak = max(peak, tracemalloc.get_traced_memory()[0] - base)
    finally:
        tracemalloc.stop()
    assert peak < resume.FOLD_AT + 40_000  # the raw window plus the text and overheads
    assert t.text().count("tok") == 2000
