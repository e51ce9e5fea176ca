"""The worker protocol: msgspec messages between the gateway and workers over core NATS.

Subjects (``prefix`` is the install's stream prefix, ``sku`` a SKU id):

- ``{prefix}.work.{sku}``: GenerateRequest, to the queue group ``{prefix}.workers.{sku}``, so
  NATS hands each request to exactly one live worker of the SKU. The request carries a reply
  inbox; a publish with no worker in the group is answered by NATS with a 503 status there.
- ``{prefix}.work.{sku}.to.{hash of worker id}``: GenerateRequest for that worker alone (the
  gateway's routing, see `direct_work_subject`); workers that announce `direct` listen there.
- ``{prefix}.cancel.{sku}``: Cancel, to every worker of the SKU (the one holding the request
  acts, the others ignore it): cheaper than tracking which worker took it before it says so.
- the request's inbox: Accepted, then TokenChunk..., then Finished (or Rejected).
- ``{prefix}.workers.announce`` / ``.heartbeat.{sku}`` / ``.gone``: presence and load.
  Telemetry, not events: nothing here is replayed, so core NATS is enough.
- ``{prefix}.workers.discover``: a gateway that starts asks every worker to announce again.

Token chunks travel on core NATS (at most once); each carries a sequence number so the gateway
notices a lost one. Their cumulative counts are what the gateway bills for the tokens it
wrote to the client (see control_plane/dataplane/gateway.py); the worker's own record of what
it generated goes to JetStream.

Evolve only by adding fields with defaults, so mixed versions keep talking.
"""

from __future__ import annotations

import hashlib
from typing import Literal

import msgspec

# "tool_calls": the choice ended after the model called tools (chat with `tools` only).
FinishReason = Literal["stop", "length", "cancelled", "error", "tool_calls"]


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    """A function call the assistant made earlier in the chat (OpenAI `tool_calls[]`)."""

    id: str
    name: str
    arguments: str  # JSON text, as OpenAI carries it


class ChatMessage(msgspec.Struct, frozen=True):
    role: Literal["system", "user", "assistant", "tool"]
    content: str
    # assistant: the calls it made; tool: which call this answers (and the function's name).
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class ResponseFormat(msgspec.Struct, frozen=True, kw_only=True):
    """OpenAI `response_format`. json_object: any JSON object; json_schema: `schema`, the
    `json_schema.schema` object as JSON text (kept as text: its key order is the order the
    model writes properties in, and the worker hashes it to cache the compiled grammar)."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    schema: str | None = None
    name: str | None = None
    # OpenAI `json_schema.strict`: no properties or items beyond those the schema names.
    strict: bool = False


class Tool(msgspec.Struct, frozen=True, kw_only=True):
    """One entry of OpenAI `tools` (type "function"), `parameters` as JSON Schema text."""

    name: str
    description: str | None = None
    parameters: str | None = None  # None: takes no parameters
    strict: bool = False


class ToolChoiceFunction(msgspec.Struct, frozen=True, kw_only=True):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`: call this one."""

    name: str


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    temperature: float = 1.0
    top_p: float = 1.0
    # The client's max_tokens; None: up to the model's context length. A worker refuses a
    # request whose prompt + max_tokens exceeds its context.
    max_tokens: int | None = None
    stop: list[str] = []
    seed: int | None = None
    # A cap set by the gateway (what admission reserved): generation stops there with finish
    # reason "length", but unlike max_tokens it is never a reason to refuse the request.
    token_budget: int | None = None

    def max_new_tokens(self, room: int | None) -> int | None:
        """Most tokens to generate, given `room` left in the context (None: unknown)."""
        limits = [
            x
            for x in (room if self.max_tokens is None else self.max_tokens, self.token_budget)
            if x is not None
        ]
        return min(limits) if limits else None


class GenerateRequest(msgspec.Struct, frozen=True, kw_only=True, tag="generate"):
    request_id: str
    tenant_id: str
    key_id: str
    sku_id: str
    model: str
    # Exactly one of: a plain prompt (completions), or messages to render with the model's
    # chat template (chat completions); or, for completions, `prompts` or `prompt_token_ids`.
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    sampling: SamplingParams = SamplingParams()
    reply_to: str
    # Epoch seconds when the gateway admitted it: the worker's TTFT/e2e clock starts here.
    admitted_at: float
    # Structured output: the text is constrained to the format by a grammar (a schema the
    # worker cannot compile is Rejected, param "response_format").
    response_format: ResponseFormat | None = None
    # Chat only: tools rendered into the prompt by the model's chat template, and tool calls
    # parsed out of the reply (TokenChunk.tool_calls). "required" or a named function
    # constrains the reply to tool calls (a grammar); "auto" lets the model choose; "none"
    # leaves the tools out of the prompt and the reply is plain text.
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction = "auto"
    parallel_tool_calls: bool = True
    # Per generated token: its logprob, and the top_logprobs (0..20) most likely tokens.
    logprobs: bool = False
    top_logprobs: int = 0
    # Choices: n sequences of each prompt; TokenChunk.index says whose text a chunk is.
    n: int = 1
    # The gateway that holds the client: the worker stops the request when that gateway's
    # lease (gateway_lease_subject) goes silent. "": no lease is watched.
    gateway_id: str = ""
    # Completions with several prompts (texts, or token ids of the model's vocabulary): each
    # prompt has its own n choices, choice c of prompt p at index p * n + c (OpenAI's order).
    # A backend that serves only `prompt` rejects them (param "prompt").
    prompts: list[str] | None = None
    prompt_token_ids: list[list[int]] | None = None
    # Completions: each choice's first chunk starts with its prompt's text and, with
    # `logprobs`, carries the prompt tokens' logprobs first (the first one's None). The gateway
    # asks for it when it cannot write the prompt itself (token ids) or needs its logprobs.
    echo: bool = False
    # Set when the whole request is larger than one NATS message may be (the connection's
    # max_payload, 1 MiB by default: a prompt of a few hundred thousand tokens): the request,
    # encoded, is this object of the JetStream object store `request_bodies_bucket`, and this
    # message carries only the ids, inbox, clock and gateway (worker/request_bodies.py).
    body_object: str | None = None

    @property
    def chat(self) -> bool:
        return self.messages is not None

    @property
    def num_prompts(self) -> int:
        if self.prompt_token_ids is not None:
            return len(self.prompt_token_ids)
        if self.prompts is not None:
            return len(self.prompts)
        return 1

    @property
    def num_choices(self) -> int:
        """Choices of all prompts: the indices 0..num_choices-1 of TokenChunk."""
        return self.n * self.num_prompts


class Cancel(msgspec.Struct, frozen=True, kw_only=True, tag="cancel"):
    request_id: str


class Accepted(msgspec.Struct, frozen=True, kw_only=True, tag="accepted"):
    """First reply: which worker holds the request, so the gateway can watch its heartbeat."""

    request_id: str
    worker_id: str


class TopLogprob(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    token: str
    logprob: float
    bytes: list[int] | None = None  # UTF-8 bytes of `token`


class TokenLogprob(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """One generated token (OpenAI `logprobs.content[]`): log-softmax of the model's raw logits
    (before temperature, top-p and any grammar mask), as vLLM reports them. None: the first
    token of an echoed prompt, which nothing predicts (sent only to a gateway that asked for
    `echo`)."""

    token: str
    logprob: float | None
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = []


class ToolCallDelta(msgspec.Struct, frozen=True, kw_only=True):
    """A piece of a tool call, as OpenAI streams them: the first delta of call `index` has its
    id (`call_<hex>`) and name, the later ones append to `arguments` (JSON text)."""

    index: int  # the call's position within its choice
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class TokenChunk(msgspec.Struct, frozen=True, kw_only=True, tag="chunk"):
    request_id: str
    seq: int  # 0, 1, 2, ... per request; a gap means a chunk was lost
    text: str  # new text since the previous chunk (may be "" while a multibyte char is pending)
    completion_tokens: int  # tokens generated so far, including this chunk's (all choices)
    prompt_tokens: int
    cached_tokens: int = 0
    index: int = 0  # the choice this chunk belongs to (n > 1)
    # One entry per token this chunk covers, when the request asked for logprobs.
    logprobs: list[TokenLogprob] | None = None
    tool_calls: list[ToolCallDelta] | None = None
    # Set on the last chunk of each choice (the request's Finished comes after the last one).
    finish_reason: FinishReason | None = None


class Finished(msgspec.Struct, frozen=True, kw_only=True, tag="finished"):
    """Last reply. Sent only after the worker's RequestFinished is acked by JetStream."""

    request_id: str
    seq: int  # the sequence number the next chunk would have had
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: FinishReason  # choice 0's
    error: str | None = None
    finish_reasons: list[FinishReason] = []  # every choice's, by index (n > 1)


class Rejected(msgspec.Struct, frozen=True, kw_only=True, tag="rejected"):
    """The request is invalid for this model (say, the prompt exceeds the context); nothing ran,
    nothing is metered. The gateway answers the client with a 400."""

    request_id: str
    message: str
    param: str | None = None
    # The OpenAI error code (say "invalid_prompt"); None: the gateway reads a refused prompt
    # or messages as context_length_exceeded, as workers without this field meant it.
    code: str | None = None


class WorkerAnnounce(msgspec.Struct, frozen=True, kw_only=True, tag="announce"):
    worker_id: str
    sku_id: str
    model: str
    backend: str
    capacity: int  # concurrent sequences it runs at full speed
    max_context: int | None = None
    # It also takes requests on `direct_work_subject` (for it alone): the gateway routes to it
    # by load and prefix affinity. False (older workers): only through the SKU's queue group.
    direct: bool = False


class WorkerHeartbeat(msgspec.Struct, frozen=True, kw_only=True, tag="heartbeat"):
    worker_id: str
    sku_id: str
    running: int
    waiting: int
    kv_pressure: float  # 0..1: share of the KV cache in use
    ts: float  # worker's epoch seconds


class WorkerGone(msgspec.Struct, frozen=True, kw_only=True, tag="gone"):
    """A worker that stops cleanly says so; one that dies is noticed by its missing heartbeat."""

    worker_id: str
    sku_id: str


Reply = Accepted | TokenChunk | Finished | Rejected
Presence = WorkerAnnounce | WorkerHeartbeat | WorkerGone

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(GenerateRequest)
_cancel_decoder = msgspec.msgpack.Decoder(Cancel)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_presence_decoder = msgspec.msgpack.Decoder(Presence)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode_request(data: bytes) -> GenerateRequest:
    return _request_decoder.decode(data)


def decode_cancel(data: bytes) -> Cancel:
    return _cancel_decoder.decode(data)


def decode_reply(data: bytes) -> Reply:
    return _reply_decoder.decode(data)


def decode_presence(data: bytes) -> Presence:
    return _presence_decoder.decode(data)


def request_bodies_bucket(prefix: str) -> str:
    """The object store that carries requests too large for one message."""
    return f"{prefix}_request_bodies"


def work_subject(prefix: str, sku_id: str) -> str:
    return f"{prefix}.work.{sku_id}"


def direct_work_subject(prefix: str, sku_id: str, worker_id: str) -> str:
    """Requests routed to one worker. Its id is hashed into one safe subject token (a host name
    holds dots, which NATS reads as token separators)."""
    token = hashlib.sha256(worker_id.encode()).hexdigest()[:20]
    return f"{prefix}.work.{sku_id}.to.{token}"


def work_queue(prefix: str, sku_id: str) -> str:
    return f"{prefix}.workers.{sku_id}"


def cancel_subject(prefix: str, sku_id: str) -> str:
    return f"{prefix}.cancel.{sku_id}"


def announce_subject(prefix: str) -> str:
    return f"{prefix}.workers.announce"


def heartbeat_subject(prefix: str, sku_id: str) -> str:
    return f"{prefix}.workers.heartbeat.{sku_id}"


def gone_subject(prefix: str) -> str:
    return f"{prefix}.workers.gone"


def discover_subject(prefix: str) -> str:
    return f"{prefix}.workers.discover"


def presence_wildcard(prefix: str) -> str:
    """Everything a gateway listens to for its registry of live workers."""
    return f"{prefix}.workers.>"


def gateway_lease_subject(prefix: str, gateway_id: str) -> str:
    """A gateway's lease: it publishes here while it lives; a worker stops the requests of a
    gateway silent too long (see worker.serve). The id is hashed into one subject token."""
    token = hashlib.sha256(gateway_id.encode()).hexdigest()[:20]
    return f"{prefix}.gateways.lease.{token}"


def gateway_lease_wildcard(prefix: str) -> str:
    return f"{prefix}.gateways.lease.*"
