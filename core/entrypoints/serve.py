"""``llmhal serve``: an OpenAI-compatible HTTP server over the engine (stdlib only).

Endpoints: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``,
and vLLM's ``GET /metrics`` (Prometheus; :mod:`llmhal.entrypoints.metrics`), ``GET /version``,
``POST /tokenize`` and ``POST /detokenize`` (:mod:`llmhal.entrypoints.tokenization`).
``"stream": true`` answers with server-sent events, with the token log-probabilities when asked,
and a usage event under ``stream_options.include_usage``. A request may ask for ``n`` completions,
and a completions request may send several prompts; every one is a request to the engine, and
requests from concurrent clients are batched by the engine loop. The ``model`` field must name the
served model (or be left out), else 404, as in vLLM. Bad input is a 400 whose message says what to
change; the server keeps serving.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import queue
import select
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from llmhal.engine.engine_loop import EngineStopped
from llmhal.entrypoints import chat_tools, tokenization
from llmhal.entrypoints import openai_protocol as api
from llmhal.entrypoints.chat_output import ChatOutput, splits_reasoning
from llmhal.entrypoints.engine_args import add_engine_args, build_llm
from llmhal.entrypoints.metrics import CONTENT_TYPE, PrometheusStatLogger
from llmhal.logger import init_logger

logger = init_logger(__name__)

# A client that sends part of a request and stalls is dropped after this many seconds (each one
# otherwise held a thread and a socket for as long as it liked).
READ_TIMEOUT_S = 60.0
# Larger bodies are a 413 (reading one allocates its whole size first).
MAX_BODY_BYTES = 32 << 20
# On Ctrl-C or SIGTERM, requests in flight are ended and their clients told so; their handlers get
# this long to write that before the process exits.
SHUTDOWN_GRACE_S = 5.0
ROUTES = (
    "the routes are GET /health, /v1/models, /metrics, /version and POST /v1/completions, "
    "/v1/chat/completions, /tokenize, /detokenize"
)


class ServerState:
    """What every request handler shares: the engine loop and the served model's name."""

    def __init__(self, llm: Any, model_name: str) -> None:
        from llmhal.engine.engine_loop import EngineLoop

        self.llm = llm
        self.model_name = model_name
        self.loop = EngineLoop(llm.engine)
        self.started = int(time.time())
        # The model's generation_config.json settings, for fields a request leaves out (vLLM).
        self.defaults = dict(llm.engine.config.extra.get("generation_defaults") or {})
        # POST handlers still running (each a thread), so a shutdown can wait for their answers.
        self.active = 0
        self.idle = threading.Condition()
        self.token_text = llm.engine.token_text  # OpenAI's `token` of a log-probability entry
        # GET /metrics: vLLM adds its Prometheus logger to the engine's unless one is supplied;
        # here it joins any plugin loggers.
        self.metrics = PrometheusStatLogger(llm.engine.config, model_name=model_name)
        llm.engine.stat_loggers.append(self.metrics)
        self.tool_parser_cls: Any = None  # build_server's tool_call_parser
        self.tool_parser_name = ""
        self.auto_tools = False
        self.reasoning_cls: Any = None  # build_server's reasoning_parser
        self.prompt_tokens_details = False  # build_server's enable_prompt_tokens_details


def make_handler(state: ServerState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "llmhal"

        @property
        def timeout(self) -> float:  # socketserver applies it to the connection (reads and writes)
            return READ_TIMEOUT_S

        def log_message(self, format: str, *args: Any) -> None:
            logger.info("%s %s", self.address_string(), format % args)

        def _json(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, code: int, message: str, kind: str = "invalid_request_error") -> None:
            try:
                self._json(code, {"error": {"message": message, "type": kind, "code": code}})
            except OSError:  # the client is gone (or stalled): nobody to tell
                self.close_connection = True

        def _client_gone(self) -> bool:
            """Whether the client closed its end (readable with nothing to read)."""
            try:
                readable, _, _ = select.select([self.connection], [], [], 0)
                return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
            except (BlockingIOError, InterruptedError):
                return False
            except OSError:
                return True

        def do_GET(self) -> None:
            if self.path == "/health":
                self._json(200, {"status": "ok"})
            elif self.path == "/v1/models":
                model = {
                    "id": state.model_name,
                    "object": "model",
                    "created": state.started,
                    "owned_by": "llmhal",
                }
                self._json(200, {"object": "list", "data": [model]})
            elif self.path == "/metrics":
                data = state.metrics.render().encode()
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            elif self.path == "/version":
                from llmhal import __version__

                self._json(200, {"version": __version__})
            else:
                self._error(
                    404,
                    f"no route {self.path}; {ROUTES}",
                    "not_found",
                )

        def do_POST(self) -> None:
            with state.idle:
                state.active += 1
            try:
                self._post()
            finally:
                with state.idle:
                    state.active -= 1
                    state.idle.notify_all()

        def _body(self) -> dict[str, Any] | None:
            """The request's JSON object, its ``model`` checked; None once an error is sent (or
            the client is gone)."""
            try:
                length = int(self.headers.get("Content-Length") or 0)
                if length < 0:
                    raise api.BadRequest("Content-Length must not be negative")
                if length > MAX_BODY_BYTES:
                    self._error(
                        413, f"the body is over {MAX_BODY_BYTES} bytes", "payload_too_large"
                    )
                    return None
                raw = self.rfile.read(length)
                if len(raw) < length:
                    self.close_connection = True  # the client closed mid-body
                    return None
                body = json.loads(raw or b"{}")
                if not isinstance(body, dict):
                    raise api.BadRequest("the request body must be a JSON object")
            except (api.BadRequest, ValueError) as e:
                self._error(400, str(e))
                return None
            except RecursionError:
                self._error(400, "the JSON body is nested too deeply")
                return None
            except OSError:  # a read timeout or a reset: drop the connection quietly
                self.close_connection = True
                return None
            model = body.get("model")
            if model is not None and model != state.model_name:
                # vLLM's answer: the model field must name the served model (or be left out).
                self._error(
                    404,
                    f"The model `{model}` does not exist; this server serves "
                    f"`{state.model_name}` (GET /v1/models)",
                    "NotFoundError",
                )
                return None
            return body

        def _post(self) -> None:
            chat = self.path == "/v1/chat/completions"
            tokens = {"/tokenize": tokenization.tokenize, "/detokenize": tokenization.detokenize}.get(self.path)  # fmt: skip
            if not chat and tokens is None and self.path != "/v1/completions":
                self._error(404, f"no route {self.path}; {ROUTES}", "not_found")
                return
            body = self._body()
            if body is None:
                return
            if tokens is not None:
                try:
                    self._json(200, tokens(body, state.llm))
                except (api.BadRequest, ValueError, TypeError) as e:
                    self._error(400, str(e))
                except OSError:
                    self.close_connection = True
                except Exception as e:  # e.g. a chat template that raises
                    self._error(400, f"{self.path[1:]} failed: {e}")
                return
            tools = None
            try:
                if chat:
                    tools = chat_tools.plan(body, state.llm.get_tokenizer(), state.tool_parser_cls, state.auto_tools)  # fmt: skip
                    if tools is not None and tools.parser_cls is not None:
                        if body.get("stream") and not chat_tools.can_stream(tools.parser_cls):
                            raise api.BadRequest(f"the {state.tool_parser_name} tool parser cannot read a stream; send stream: false")  # fmt: skip
                        body = tools.parser().adjust_request(body)  # type: ignore[union-attr]
                elif "tools" in body or "tool_choice" in body:
                    raise api.BadRequest("tools are only supported on /v1/chat/completions")
                params = api.sampling_params(body, chat=chat, defaults=state.defaults)
                if tools is not None and tools.structured is not None:
                    if params.structured_outputs is not None:
                        raise api.BadRequest("a named or required tool_choice already constrains the output; drop response_format/structured_outputs")  # fmt: skip
                    params = dataclasses.replace(params, structured_outputs=tools.structured)
                include_usage = api.stream_options(body)
                if chat:
                    template_tools = tools.tools if tools is not None else None
                    prompts = [state.llm.chat_prompt(api.chat_messages(body), tools=template_tools)]
                else:
                    prompts = api.completion_prompts(body)
                rids, q = state.loop.submit(api.choices(api.salted(prompts, body), params))
            except EngineStopped as e:
                self._error(503, str(e), "service_unavailable")
                return
            except (api.BadRequest, ValueError, TypeError) as e:
                self._error(400, str(e))
                return
            except Exception as e:  # never leave the client without an answer
                logger.exception("Could not queue a request")
                self._error(500, f"could not queue the request: {e}", "server_error")
                return
            echo = self._prompt_text if body.get("echo") else None
            # OpenAI's id shapes, unique across restarts (the engine's request ids are not).
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            output = None
            if chat and (tools is not None or state.reasoning_cls is not None):
                ids = prompts[0].get("prompt_token_ids") if isinstance(prompts[0], dict) else None
                reasoning_cls = splits_reasoning(
                    state.reasoning_cls, state.llm.get_tokenizer(), params.structured_outputs,
                    state.llm.engine.reasoner is not None, ids or [],
                )  # fmt: skip
                output = ChatOutput(tools, reasoning_cls, state.llm.get_tokenizer(), body)
            answer = Answer(rid, len(rids), params.n, chat, echo, api.echo_only(body), output, rids)  # fmt: skip
            try:
                if body.get("stream"):
                    self._stream(answer, q, include_usage)
                else:
                    self._complete(answer, q)
            except OSError:  # the client went away or stalled: stop generating for it
                self.close_connection = True
                state.loop.abort(rids)

        def _prompt_text(self, out: Any) -> str:
            """An echoed prompt: as sent, or a token-id prompt's decoded text."""
            if out.prompt is not None:
                return out.prompt
            return state.llm.get_tokenizer().decode(out.prompt_token_ids)

        def _updates(self, q: Any, answer: Answer):
            from llmhal.engine.engine_loop import FINISHED

            checked = time.monotonic()
            while True:
                # A client who hangs up is looked for every quarter second (streams notice when a
                # write fails; a non-streaming request would otherwise run to max_tokens).
                try:
                    item = q.get(timeout=0.25)
                except queue.Empty:
                    item = None
                if time.monotonic() - checked >= 0.25:
                    checked = time.monotonic()
                    if self._client_gone():
                        raise ConnectionResetError("the client closed the connection")
                if item is None:
                    continue
                if item is FINISHED:
                    return
                if isinstance(item, Exception):
                    raise item
                index, out = item
                yield index, api.without_generation(out) if answer.echo_only else out

        def _complete(self, answer: Answer, q: Any) -> None:
            last: list[Any] = [None] * answer.size
            try:
                for index, out in self._updates(q, answer):
                    last[index] = out
            except OSError:
                raise
            except EngineStopped as e:
                self._error(503, f"{e}; the request was ended unfinished", "service_unavailable")
                return
            except Exception as e:
                self._error(500, f"generation failed: {e}", "server_error")
                return
            try:  # a parser plugin may fail on this text
                body = api.full_response(
                    answer.id,
                    state.model_name,
                    last,
                    chat=answer.chat,
                    n=answer.n,
                    token_text=state.token_text,
                    echo=answer.echo,
                    output=answer.output,
                    details=state.prompt_tokens_details,
                )
            except Exception as e:
                logger.exception("Could not read the answer's reasoning or tool calls")
                self._error(500, f"reading the answer failed: {e}", "server_error")
                return
            self._json(200, body)

        def _stream(self, answer: Answer, q: Any, include_usage: bool) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            # Per choice: characters and tokens already sent, and where the tokens' text starts.
            chars = [0] * answer.size
            tokens = [0] * answer.size
            offsets = [0] * answer.size
            last: list[Any] = [None] * answer.size
            streams = [answer.output.stream() for _ in range(answer.size)] if answer.output else None  # fmt: skip
            try:
                for index, out in self._updates(q, answer):
                    last[index] = out
                    text, ids, entries = api.choice_view(out, answer.echo)
                    delta = text[chars[index] :]
                    if not delta and not out.finished:
                        continue  # bytes of a character still incomplete: send them with it
                    finish, calls, reasoning = out.outputs[0].finish_reason, [], ""
                    if streams is not None:
                        delta, reasoning, calls, finish = streams[index].step(text, ids, finish)
                        if not delta and not reasoning and not calls and finish is None:
                            continue  # held back (a tag or a call being written)
                    logprobs = api.logprobs_of(
                        ids[tokens[index] :],
                        None if entries is None else entries[tokens[index] :],
                        answer.chat,
                        state.token_text,
                        offsets[index],
                    )
                    if logprobs is not None and not answer.chat:
                        offsets[index] += sum(len(t) for t in logprobs["tokens"])
                    first = chars[index] == 0 and tokens[index] == 0
                    if reasoning and (delta or calls or finish):
                        # A delta carries reasoning or an answer, never both (vLLM's rule).
                        self._chunk(answer, index, "", None, include_usage, first=first, reasoning=reasoning)  # fmt: skip
                        reasoning, first = "", False
                    self._chunk(
                        answer, index, delta, finish, include_usage, first=first,
                        logprobs=logprobs, tool_calls=[c.to_dict() for c in calls], reasoning=reasoning,
                    )  # fmt: skip
                    chars[index], tokens[index] = len(text), len(ids)
                if include_usage:
                    usage = api.usage_chunk(answer.id, state.model_name, last, chat=answer.chat, n=answer.n, details=state.prompt_tokens_details)  # fmt: skip
                    self._event(usage)
            except OSError:
                raise
            except Exception as e:
                state.loop.abort(list(answer.rids))  # nobody will read the other choices now
                stopped = isinstance(e, EngineStopped)
                message = (
                    f"{e}; the request was ended unfinished"
                    if stopped
                    else f"generation failed: {e}"
                )
                kind = "service_unavailable" if stopped else "server_error"
                self._event({"error": {"message": message, "type": kind}})
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

        def _chunk(self, answer: Answer, index: int, delta: str, finish: str | None, include_usage: bool, **kw: Any) -> None:  # fmt: skip
            chunk = api.stream_chunk(answer.id, state.model_name, delta, finish, chat=answer.chat, index=index, **kw)  # fmt: skip
            if include_usage:
                chunk["usage"] = None  # OpenAI's shape: the counts come last
            self._event(chunk)

        def _event(self, body: dict[str, Any]) -> None:
            self.wfile.write(b"data: " + json.dumps(body).encode() + b"\n\n")
            self.wfile.flush()

    return Handler


@dataclass(frozen=True)
class Answer:
    """What a response is built around: its id, how many choices, how many
    completions per prompt, whether it is a chat completion, and for ``echo`` what gives a
    choice's prompt text and whether only the prompt comes back."""

    id: str
    size: int
    n: int
    chat: bool
    echo: Callable[[Any], str] | None = None
    echo_only: bool = False
    output: Any = None  # chat_output.ChatOutput: reasoning and tool calls read from the text
    rids: tuple[str, ...] | list[str] = ()  # the engine's requests behind the choices


class _Server(ThreadingHTTPServer):
    # socketserver's default listen queue is 5: a burst of 40 clients saw connection resets.
    request_queue_size = 256


def build_server(
    llm: Any,
    host: str = "127.0.0.1",
    port: int = 8000,
    model_name: str | None = None,
    *,
    tool_call_parser: str | None = None,
    enable_auto_tool_choice: bool = False,
    reasoning_parser: str | None = None,
    enable_prompt_tokens_details: bool = False,
) -> ThreadingHTTPServer:
    """The server of ``llm``; clients name the model ``model_name`` (default: the model's path,
    or ``SmolLM2-135M-Instruct.Q4_1`` for the default model, as the CLI does).
    ``tool_call_parser`` names the parser that reads ``tool_choice: "auto"`` calls, which
    ``enable_auto_tool_choice`` allows (vLLM's two flags); ``reasoning_parser`` splits chat
    answers' reasoning off (it is checked against the model's vocabulary now). Unknown names are a
    KeyError. ``enable_prompt_tokens_details`` adds the prompt tokens found in the prefix cache to
    each answer's usage (vLLM's flag)."""
    # Every name is checked before anything starts (the engine loop, the listening socket).
    tool_cls = None
    if tool_call_parser is not None:
        from llmhal.tool_parsers.manager import ToolParserManager

        tool_cls = ToolParserManager.get_tool_parser(tool_call_parser)
    # The engine's reasoning gate (structured_outputs_config) and the answers' split use one
    # parser: by default the engine's.
    engine_parser = llm.engine.config.structured_outputs_reasoning_parser
    if reasoning_parser is None:
        reasoning_parser = engine_parser
    elif engine_parser is not None and engine_parser != reasoning_parser:
        raise ValueError(
            f"reasoning_parser {reasoning_parser!r} differs from the engine's {engine_parser!r} "
            "(structured_outputs_config); use one"
        )
    reasoning_cls = None
    if reasoning_parser is not None:
        from llmhal.reasoning.manager import ReasoningParserManager

        reasoning_cls = ReasoningParserManager.get_reasoning_parser(reasoning_parser)
        reasoning_cls(llm.get_tokenizer())  # a model without its tags fails here, not per request
    state = ServerState(llm, model_name or _default_name(llm.load_report.model_path))
    state.tool_parser_cls, state.tool_parser_name = tool_cls, tool_call_parser or ""
    state.auto_tools = enable_auto_tool_choice
    state.reasoning_cls = reasoning_cls
    state.prompt_tokens_details = enable_prompt_tokens_details
    server = _Server((host, port), make_handler(state))
    server.daemon_threads = True
    server.state = state  # type: ignore[attr-defined]
    return server


def _default_name(model_path: str) -> str:
    from llmhal.default_model import FILENAME

    return FILENAME.removesuffix(".gguf") if model_path.endswith(FILENAME) else model_path


def shutdown_server(server: ThreadingHTTPServer, grace_s: float = SHUTDOWN_GRACE_S) -> int:
    """Stop listening, end the requests in flight (their clients get a 503, or an error event and
    ``[DONE]`` on a stream), and wait up to ``grace_s`` for those answers to be written. Returns
    how many requests were ended. Call after ``serve_forever`` has returned."""
    state: ServerState = server.state  # type: ignore[attr-defined]
    server.server_close()
    ended = state.loop.shutdown()
    deadline = time.monotonic() + grace_s
    with state.idle:
        while state.active and time.monotonic() < deadline:
            state.idle.wait(timeout=max(0.0, deadline - time.monotonic()))
    return ended


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM shuts down as Ctrl-C does


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 0-65535, got {port}")
    return port


def _cannot_listen(host: str, port: int) -> str | None:
    """Why the server could not listen on (host, port), trying it as the server will; None if it can."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as HTTPServer does
            probe.bind((host, port))
    except OSError as e:
        return e.strerror or str(e)
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="llmhal serve", description="OpenAI-compatible HTTP server (completions and chat)."
    )
    add_engine_args(p)
    p.add_argument(
        "--served-model-name",
        help="the model id clients send and see (default: --model as given, as in vLLM; for the "
        "default model, its file name without .gguf)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8000, help="TCP port (default 8000; 0: any free)")
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=64,
        help="requests batched together at most (default 64)",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let chat requests use tool_choice "auto" (needs --tool-call-parser)',
    )
    from llmhal.reasoning.manager import ReasoningParserManager as Reasoners
    from llmhal.tool_parsers.manager import ToolParserManager as ToolParsers

    p.add_argument("--tool-call-parser", help=f"how the model writes tool calls: {', '.join(ToolParsers.list_registered())}")  # fmt: skip
    p.add_argument(
        "--tool-parser-plugin",
        help="a Python file, or an importable module's name, that registers more tool-call parsers",
    )
    p.add_argument("--reasoning-parser", help=f"split reasoning off chat answers: {', '.join(Reasoners.list_registered())}")  # fmt: skip
    p.add_argument(
        "--reasoning-parser-plugin",
        help="a Python file, or an importable module's name, that registers more reasoning parsers",
    )
    p.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="report the prompt tokens found in the prefix cache in each answer's usage "
        "(prompt_tokens_details.cached_tokens)",
    )
    a = p.parse_args(argv)
    if a.reasoning_parser_plugin:
        from llmhal.reasoning.manager import ReasoningParserManager

        ReasoningParserManager.import_reasoning_parser(a.reasoning_parser_plugin)
    if a.reasoning_parser:
        from llmhal.reasoning.manager import ReasoningParserManager

        if a.reasoning_parser not in ReasoningParserManager.list_registered():
            known = ", ".join(ReasoningParserManager.list_registered())
            print(f"llmhal serve: unknown --reasoning-parser {a.reasoning_parser!r} (known: {known})", file=sys.stderr)  # fmt: skip
            return 2
    if a.tool_parser_plugin:
        from llmhal.tool_parsers.manager import ToolParserManager

        ToolParserManager.import_tool_parser(a.tool_parser_plugin)
    if a.enable_auto_tool_choice and not a.tool_call_parser:
        print("llmhal serve: --enable-auto-tool-choice needs --tool-call-parser", file=sys.stderr)
        return 2
    if a.tool_call_parser:
        from llmhal.tool_parsers.manager import ToolParserManager

        if a.tool_call_parser not in ToolParserManager.list_registered():
            known = ", ".join(ToolParserManager.list_registered())
            print(f"llmhal serve: unknown --tool-call-parser {a.tool_call_parser!r} (known: {known})", file=sys.stderr)  # fmt: skip
            return 2
    # A taken port or a bad address is reported before the model loads (seconds), not after.
    why = _cannot_listen(a.host, a.port)
    if why:
        print(f"llmhal serve: cannot listen on {a.host}:{a.port}: {why}", file=sys.stderr)
        return 2
    llm = build_llm("llmhal serve", a, max_num_seqs=a.max_num_seqs)
    if llm is None:
        return 2
    try:
        server = build_server(
            llm, a.host, a.port, a.served_model_name or a.model,
            tool_call_parser=a.tool_call_parser, enable_auto_tool_choice=a.enable_auto_tool_choice,
            reasoning_parser=a.reasoning_parser, enable_prompt_tokens_details=a.enable_prompt_tokens_details,
        )  # fmt: skip
    except (ValueError, RuntimeError) as e:  # a reasoning parser whose tags the model lacks
        print(f"llmhal serve: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # taken between the check and now
        print(f"llmhal serve: cannot listen on {a.host}:{a.port}: {e}", file=sys.stderr)
        return 2
    print(
        f"llmhal serve: http://{a.host}:{server.server_address[1]}/v1 ({server.state.model_name})",
        file=sys.stderr,
    )  # type: ignore[attr-defined]
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        ended = shutdown_server(server)
        print(
            f"llmhal serve: stopped; {ended} request(s) in flight were ended unfinished",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
