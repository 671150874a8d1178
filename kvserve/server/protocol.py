"""Request bodies of the HTTP API (pydantic) and their checks.

Follows the OpenAI API for ``/v1/completions`` and ``/v1/chat/completions`` and
SGLang's native ``/generate``, ``/open_session`` and ``/close_session``; all three
generation routes take SGLang's ``session_params`` (``session_params``). Unknown
fields are ignored (as OpenAI and vLLM do);
every refusal is an ``ApiError`` that the app renders in OpenAI's error shape:
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvserve.engine import parse_sampling
from kvserve.engine.api import chat_session_params, parse_session_params
from kvserve.sched.req import RequestRejected, SamplingParams
from kvserve.sched.session import SessionError, SessionParams

MAX_STOP_STRINGS = 16  # more is refused (OpenAI allows 4; vLLM sets no bound)
MAX_STOP_CHARS = 512
MAX_COMPLETION_LOGPROBS = 1  # only the chosen token's log-probability is computed
MAX_CHAT_TOP_LOGPROBS = 0


class ApiError(Exception):
    """An HTTP error with an OpenAI-shaped body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.status}}


def check_stop_limits(stops: list[Any]) -> None:
    """At most ``MAX_STOP_STRINGS`` stop strings of at most ``MAX_STOP_CHARS`` characters
    (each is matched after every token). Raises ApiError(400) naming ``stop``."""
    if len(stops) > MAX_STOP_STRINGS:
        raise ApiError(400, f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}",
                       "stop")
    if any(isinstance(s, str) and len(s) > MAX_STOP_CHARS for s in stops):
        raise ApiError(400, f"stop strings are at most {MAX_STOP_CHARS} characters", "stop")


def session_params(value: dict[str, Any] | None, chat: bool = False) -> SessionParams | None:
    """The checked ``session_params`` of a request (``chat``: only ``id`` and
    ``replace``, the messages being the whole conversation). Raises ApiError(400) naming
    ``session_params``; whether the session and turn ``rid`` exist the engine says."""
    try:
        return chat_session_params(value) if chat else parse_session_params(value)
    except SessionError as err:
        raise ApiError(400, str(err), "session_params") from None


class _Body(BaseModel):
    # strict: a JSON type mismatch ("stream": "yes", "max_tokens": true) is a 400, as at
    # OpenAI, not a silent coercion (ints still pass for floats)
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class OpenAIRequest(_Body):
    """Fields both OpenAI endpoints share, plus SGLang/vLLM extras (top_k, min_p, ...)."""

    model: str
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0  # vLLM's extension: SamplingParams.min_new_tokens
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    rid: str | None = None  # kvserve/SGLang extension: the request id (abort_request)
    session_params: dict[str, Any] | None = None  # SGLang extension: a session's turn

    def sampling(self, max_tokens: int | None, default_max: int, context_len: int,
                 logprob: bool) -> SamplingParams:
        """Checked ``SamplingParams``; raises ApiError(400) naming the bad field."""
        if self.n != 1:
            raise ApiError(400, f"n={self.n} is not supported: kvserve returns one choice "
                           "per request (send n requests instead)", "n")
        if self.presence_penalty or self.frequency_penalty:
            raise ApiError(400, "presence_penalty and frequency_penalty are not supported",
                           "presence_penalty" if self.presence_penalty else "frequency_penalty")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        check_stop_limits(stops)
        limit = default_max if max_tokens is None else max_tokens
        if not 0 <= limit <= context_len:
            raise ApiError(400, f"max_tokens must be in [0, {context_len}] (the context "
                           f"length), got {limit}", "max_tokens")
        if not 0 <= self.min_tokens <= limit:
            raise ApiError(400, f"min_tokens must be in [0, {limit}] (max_tokens), got "
                           f"{self.min_tokens}", "min_tokens")
        try:
            return parse_sampling({
                "max_new_tokens": limit, "temperature": self.temperature,
                "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
                "stop": [s for s in stops if s], "stop_token_ids": self.stop_token_ids or (),
                "seed": self.seed, "ignore_eos": self.ignore_eos, "return_logprob": logprob,
                "min_new_tokens": self.min_tokens,
            })
        except RequestRejected as err:
            raise ApiError(400, str(err)) from None


class CompletionRequest(OpenAIRequest):
    """``POST /v1/completions``. ``prompt``: a string or a list of token ids (a list of
    one string or of one id list is accepted too)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def check(self) -> None:
        if self.logprobs is not None and not 0 <= self.logprobs <= 5:
            raise ApiError(400, f"logprobs must be in [0, 5], got {self.logprobs}", "logprobs")
        if self.logprobs is not None and self.logprobs > MAX_COMPLETION_LOGPROBS:
            raise ApiError(400, "only the chosen token's log-probability is returned: "
                           f"logprobs must be 0 or 1, got {self.logprobs}", "logprobs")
        if self.echo:
            raise ApiError(400, "echo is not supported", "echo")
        if self.suffix:
            raise ApiError(400, "suffix is not supported", "suffix")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(OpenAIRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def check(self) -> None:
        if not self.messages:
            raise ApiError(400, "messages must not be empty", "messages")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise ApiError(400, f"top_logprobs must be in [0, 20], got {self.top_logprobs}",
                           "top_logprobs")
        if self.top_logprobs:
            raise ApiError(400, "top_logprobs > 0 is not supported (only the chosen token's "
                           "log-probability is computed)", "top_logprobs")

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


class GenerateRequest(_Body):
    """``POST /generate`` in SGLang's native shape."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    rid: str | None = None
    return_logprob: bool = False
    session_params: dict[str, Any] | None = None  # {"id", "rid", "offset", "replace"}

    def sampling(self, context_len: int) -> SamplingParams:
        params = dict(self.sampling_params)
        params.setdefault("return_logprob", self.return_logprob)
        stop = params.get("stop")
        check_stop_limits([stop] if isinstance(stop, str) else stop
                          if isinstance(stop, list) else [])
        limit = params.get("max_new_tokens", 128)
        if isinstance(limit, int) and limit > context_len:
            raise ApiError(400, f"max_new_tokens must be at most {context_len} (the context "
                           f"length), got {limit}", "max_new_tokens")
        try:
            return parse_sampling(params)
        except (RequestRejected, TypeError) as err:
            raise ApiError(400, f"bad sampling_params: {err}", "sampling_params") from None


class AbortRequest(_Body):
    rid: str


class OpenSessionRequest(_Body):
    """``POST /open_session`` (SGLang's ``OpenSessionReqInput``)."""

    capacity_of_str_len: int | None = None  # most tokens a turn's context may hold
    session_id: str | None = None  # None: the server picks one


class CloseSessionRequest(_Body):
    """``POST /close_session``."""

    session_id: str
