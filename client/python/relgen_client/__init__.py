"""A small typed wrapper over relgen.v1.GenerationService (unary, streaming and scoring)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Sequence, Union

import grpc

from relgen.v1 import generation_pb2 as pb
from relgen.v1 import generation_pb2_grpc as pb_grpc

__all__ = ["Client", "Completion", "Sample", "Chunk", "TokenLogprob", "ScoreResult", "ContinuationScore",
           "RelgenError"]

_FINISH = {pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_EOS: "eos"}


class RelgenError(Exception):
    """A call that ended with a gRPC error; `code` is the status name, e.g. "INVALID_ARGUMENT"."""

    def __init__(self, code: str, details: str):
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: List["TokenLogprob"] = field(default_factory=list)
    text: str = ""


@dataclass
class Sample:
    """One of a request's n samples (drawn with the request's seed + index)."""
    index: int
    text: str
    token_ids: List[int]
    finish_reason: str
    generated_tokens: int
    logprobs: List[TokenLogprob] = field(default_factory=list)
    beam_score: float = 0.0  # beam search: the sequence's score


@dataclass
class Completion:
    """The whole answer. text, token_ids, finish_reason and logprobs are sample 0's; `samples` holds
    every sample (one when n is 1); generated_tokens counts all samples'."""
    request_id: str
    text: str
    token_ids: List[int]
    finish_reason: str
    prompt_tokens: int
    generated_tokens: int
    time_to_first_token_s: float
    total_s: float
    logprobs: List[TokenLogprob] = field(default_factory=list)
    samples: List[Sample] = field(default_factory=list)
    # With prompt_logprobs: one per prompt token from the second on (token_id is the prompt's).
    prompt_logprobs: List[TokenLogprob] = field(default_factory=list)
    beam_score: float = 0.0  # beam search: sample 0's score


@dataclass
class Chunk:
    """Part of a stream, of sample `sample_index`; each sample's last chunk has finish_reason set and
    that sample's usage and timing filled. With prompt_logprobs, sample 0's first chunk carries them."""
    text: str
    token_ids: List[int]
    finish_reason: Optional[str] = None
    prompt_tokens: int = 0
    generated_tokens: int = 0
    time_to_first_token_s: float = 0.0
    total_s: float = 0.0
    logprobs: List[TokenLogprob] = field(default_factory=list)
    sample_index: int = 0
    prompt_logprobs: List[TokenLogprob] = field(default_factory=list)
    beam_score: float = 0.0  # beam search, on each sequence's final chunk


@dataclass
class ContinuationScore:
    """A scored continuation: each token's log-probability after the context and the tokens before
    it, and their sum."""
    token_ids: List[int]
    logprobs: List[TokenLogprob]
    sum_logprob: float


@dataclass
class ScoreResult:
    request_id: str
    scores: List[ContinuationScore]  # in the order the continuations were given
    prompt_tokens: int  # the context's
    continuation_tokens: int
    total_s: float


def _logprobs(infos) -> List[TokenLogprob]:
    return [TokenLogprob(i.token_id, i.logprob, [TokenLogprob(a.token_id, a.logprob, text=a.text) for a in i.top_logprobs])
            for i in infos]


class Client:
    """Connects to a relgen-server. `tls_ca`: PEM roots to connect with TLS; `timeout`: default
    per-call deadline in seconds."""

    def __init__(self, target: str = "localhost:50051", *, tls_ca: Optional[bytes] = None,
                 timeout: Optional[float] = None):
        if tls_ca is not None:
            self._channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=tls_ca))
        else:
            self._channel = grpc.insecure_channel(target)
        self._stub = pb_grpc.GenerationServiceStub(self._channel)
        self._timeout = timeout

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def _request(prompt: Union[str, Sequence[int]], *, max_new_tokens=None, temperature=None, top_k=None, top_p=None,
                 repetition_penalty=None, seed=None, stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (),
                 logprobs=None, ignore_eos: bool = False, request_id: str = "", n=None,
                 prompt_logprobs=None, presence_penalty=None, frequency_penalty=None, logit_bias=None,
                 allowed_token_ids: Sequence[int] = (), bad_words: Sequence[Sequence[int]] = (), min_tokens=None,
                 min_p=None, truncate_prompt_tokens=None, skip_special_tokens=None,
                 no_repeat_ngram_size=None, num_beams=None, length_penalty=None, early_stopping=None,
                 num_return_sequences=None, adapter: str = "") -> pb.GenerateRequest:
        r = pb.GenerateRequest(request_id=request_id, stop=list(stop), stop_token_ids=list(stop_token_ids),
                               ignore_eos=ignore_eos, allowed_token_ids=list(allowed_token_ids), adapter=adapter)
        for word in bad_words:
            r.bad_words.add().ids.extend(int(t) for t in word)
        for token, bias in (logit_bias or {}).items():
            r.logit_bias[int(token)] = float(bias)
        if isinstance(prompt, str):
            r.text = prompt
        else:
            r.token_ids.ids.extend(int(t) for t in prompt)
        for name, value in (("max_new_tokens", max_new_tokens), ("temperature", temperature), ("top_k", top_k),
                            ("top_p", top_p), ("repetition_penalty", repetition_penalty), ("seed", seed),
                            ("logprobs", logprobs), ("n", n), ("prompt_logprobs", prompt_logprobs),
                            ("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty),
                            ("min_tokens", min_tokens), ("min_p", min_p),
                            ("truncate_prompt_tokens", truncate_prompt_tokens),
                            ("skip_special_tokens", skip_special_tokens),
                            ("no_repeat_ngram_size", no_repeat_ngram_size), ("num_beams", num_beams),
                            ("length_penalty", length_penalty), ("num_return_sequences", num_return_sequences)):
            if value is not None:
                setattr(r, name, value)
        if early_stopping is not None:  # transformers' values: True, False or "never"
            r.early_stopping = {False: pb.EARLY_STOPPING_FALSE, True: pb.EARLY_STOPPING_TRUE,
                                "never": pb.EARLY_STOPPING_NEVER}[early_stopping]
        return r

    def generate(self, prompt: Union[str, Sequence[int]], *, timeout: Optional[float] = None, **params) -> Completion:
        """Generates the whole continuation. `params` are the GenerateRequest fields, among them
        `n` (samples, 1..16), `prompt_logprobs` (k, 0..20) and `adapter` (a LoRA adapter's name)."""
        try:
            resp = self._stub.Generate(self._request(prompt, **params), timeout=timeout or self._timeout)
        except grpc.RpcError as e:
            raise RelgenError(e.code().name, e.details()) from None
        finish = _FINISH.get(resp.finish_reason, "unspecified")
        if resp.samples:
            samples = [Sample(s.index, s.text, list(s.token_ids), _FINISH.get(s.finish_reason, "unspecified"),
                              s.generated_tokens, _logprobs(s.logprobs), s.beam_score) for s in resp.samples]
        else:  # n = 1: the server sends the one sample in the top-level fields only
            samples = [Sample(0, resp.text, list(resp.token_ids), finish, resp.usage.generated_tokens,
                              _logprobs(resp.logprobs), resp.beam_score)]
        return Completion(resp.request_id, resp.text, list(resp.token_ids), finish, resp.usage.prompt_tokens,
                          resp.usage.generated_tokens, resp.timing.time_to_first_token_seconds,
                          resp.timing.total_seconds, _logprobs(resp.logprobs), samples,
                          _logprobs(resp.prompt_logprobs), resp.beam_score)

    def score(self, context: Union[str, Sequence[int]], continuations: Sequence[Union[str, Sequence[int]]], *,
              top_logprobs: Optional[int] = None, request_id: str = "", adapter: str = "",
              timeout: Optional[float] = None) -> ScoreResult:
        """Log-probabilities of each continuation (text or token ids; 1..64, each non-empty) after the
        context (text or token ids), with `top_logprobs` alternatives per token, under the LoRA adapter
        named `adapter` (empty: the base)."""
        r = pb.ScoreRequest(request_id=request_id, adapter=adapter)
        if isinstance(context, str):
            r.text = context
        else:
            r.token_ids.ids.extend(int(t) for t in context)
        for c in continuations:
            if isinstance(c, str):
                r.continuations.add(text=c)
            else:
                r.continuations.add().token_ids.ids.extend(int(t) for t in c)
        if top_logprobs is not None:
            r.top_logprobs = top_logprobs
        try:
            resp = self._stub.Score(r, timeout=timeout or self._timeout)
        except grpc.RpcError as e:
            raise RelgenError(e.code().name, e.details()) from None
        return ScoreResult(resp.request_id,
                           [ContinuationScore(list(s.token_ids), _logprobs(s.logprobs), s.sum_logprob) for s in resp.scores],
                           resp.usage.prompt_tokens, resp.usage.continuation_tokens, resp.timing.total_seconds)

    def stream(self, prompt: Union[str, Sequence[int]], *, timeout: Optional[float] = None, **params) -> Iterator[Chunk]:
        """Yields the continuation as it is generated; closing the iterator cancels the request. With
        n > 1 the samples' chunks interleave (Chunk.sample_index); the stream ends once all finished."""
        call = self._stub.GenerateStream(self._request(prompt, **params), timeout=timeout or self._timeout)
        try:
            for m in call:
                c = Chunk(m.text_delta, list(m.token_ids), logprobs=_logprobs(m.logprobs), sample_index=m.sample_index,
                          prompt_logprobs=_logprobs(m.prompt_logprobs))
                if m.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    c.finish_reason = _FINISH.get(m.finish_reason, "unspecified")
                    c.prompt_tokens, c.generated_tokens = m.usage.prompt_tokens, m.usage.generated_tokens
                    c.time_to_first_token_s, c.total_s = m.timing.time_to_first_token_seconds, m.timing.total_seconds
                    c.beam_score = m.beam_score
                yield c
        except grpc.RpcError as e:
            raise RelgenError(e.code().name, e.details()) from None
        finally:
            call.cancel()

    def info(self) -> dict:
        """The served model and the server's limits."""
        from google.protobuf.json_format import MessageToDict

        try:
            info = self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self._timeout)
        except grpc.RpcError as e:
            raise RelgenError(e.code().name, e.details()) from None
        return MessageToDict(info, preserving_proto_field_name=True)
