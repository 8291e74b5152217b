"""``llmhal serve``: an OpenAI-compatible HTTP server over the engine (FastAPI on uvicorn).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed as server-sent events
with ``"stream": true``), ``GET /v1/models``, ``GET /health``, ``/ping``, ``/load``, vLLM's
``GET /metrics`` (Prometheus; :mod:`llmhal.entrypoints.metrics`), ``GET /version``, ``POST
/tokenize`` and ``POST /detokenize`` (:mod:`llmhal.entrypoints.tokenization`), ``GET
/tokenizer_info`` (with ``--enable-tokenizer-info-endpoint``), and ``GET /openapi.json`` and
``/docs``. The app is :mod:`llmhal.entrypoints.api_server`; requests are run by
:mod:`llmhal.entrypoints.api_completions`. Requests from concurrent clients are batched by the
engine loop; connections are the ASGI server's (one event loop, no thread per connection). FastAPI
and uvicorn are imported only when a server is built (``import llmhal`` stays cheap).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import signal
import socket
import sys
import threading
from typing import Any

from llmhal.entrypoints.engine_args import add_engine_args, build_llm
from llmhal.logger import init_logger

logger = init_logger(__name__)

# On Ctrl-C or SIGTERM, requests in flight are ended and their clients told so; their handlers get
# this long to write that before the process exits.
SHUTDOWN_GRACE_S = 5.0
DEFAULT_MAX_REQUEST_BYTES = 8 << 20
# uvicorn answers 503 past this many connections and requests in progress.
DEFAULT_MAX_CONNECTIONS = 2048
# The server's step budget unless --max-num-batched-tokens says otherwise: max_num_seqs plus this.
# A step computes every running stream's next token first and then at most this many prompt
# tokens, so a new prompt is prefilled in chunks beside the streams instead of stalling them for
# one long step, and even with every sequence slot decoding a new prompt still advances. (On the
# CPU platform a token costs about as much in a batch as alone, so a step's time is about its
# token count: with a 2048-token budget one step stalled 16 streams for seconds.)
SERVE_PREFILL_TOKENS_PER_STEP = 64
# The server's --decode-pace-factor unless given: while streams decode, a step that also prefills
# may take 1.5 times a decode-only step (llmhal.engine.step_budget), so their inter-token gaps stay
# near their decode pace while new prompts prefill. Measured on the default model at 16 streams
# (llmhal bench serve, 9 runs, at least 16 prompt tokens a step): 1.5 kept inter-token p99 at
# 2-3.7x one stream's (median 2.8x), off 7-12x. There the step's floor of prompt tokens, not this
# factor, sets the steps (see llmhal.engine.step_budget.MIN_PREFILL_TOKENS).
SERVE_DECODE_PACE_FACTOR = 1.5
# Step graphs recorded at start-up for up to this many decoding streams (llmhal.engine.graph_warmup):
# 84 shapes, ~6 s on the default model on 2 vCPUs; more streams record their shapes when met.
SERVE_GRAPH_WARMUP_DECODES = 64


def apply_serving_defaults(args: argparse.Namespace) -> None:
    """The engine settings ``llmhal serve`` uses where the command line leaves them out."""
    if getattr(args, "max_num_batched_tokens", None) is None:
        args.max_num_batched_tokens = args.max_num_seqs + SERVE_PREFILL_TOKENS_PER_STEP
    if getattr(args, "decode_pace_factor", None) is None:
        args.decode_pace_factor = SERVE_DECODE_PACE_FACTOR


class ApiServer:
    """uvicorn serving the app on a socket bound at construction (so ``server_address`` is known
    at once, port 0 included), with the ``socketserver`` calls the CLI and tests use:
    :meth:`serve_forever` (blocking), :meth:`shutdown` (from another thread: stop accepting
    connections) and :meth:`server_close`."""

    def __init__(self, app: Any, state: Any, host: str, port: int, max_connections: int, root_path: str = "") -> None:  # fmt: skip
        import uvicorn

        self.state = state
        self.socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, port))
        self.socket.listen(2048)
        self.server_address = self.socket.getsockname()[:2]
        config = uvicorn.Config(
            app, log_config=None, access_log=False, lifespan="off", backlog=2048,
            timeout_graceful_shutdown=int(SHUTDOWN_GRACE_S), limit_concurrency=max_connections,
            timeout_keep_alive=5, root_path=root_path,
        )  # fmt: skip
        self._uv = _uvicorn_server_class()(config)
        self._running = threading.Event()
        self._done = threading.Event()
        self._done.set()

    def serve_forever(self, end_requests_on_stop: bool = False) -> None:
        """Serve until :meth:`shutdown` (or, in the main thread, Ctrl-C/SIGTERM); with
        ``end_requests_on_stop`` the requests in flight are ended (:func:`shutdown_server`) as
        soon as the port closes, so their answers are written before this returns."""
        self._uv.on_stop = (lambda: self.state.loop.shutdown()) if end_requests_on_stop else None
        self._done.clear()
        self._running.set()
        try:
            self._uv.run(sockets=[self.socket])
        finally:
            self._running.clear()
            self._done.set()

    def shutdown(self) -> None:
        """Stop accepting connections; requests in flight go on (end them with
        :func:`shutdown_server`). Returns once the port is closed."""
        self._uv.should_exit = True
        if self._running.is_set():
            self._uv.stopped_listening.wait(timeout=10)

    def server_close(self) -> None:
        self.socket.close()

    @property
    def ended(self) -> int:
        return self._uv.ended


def _uvicorn_server_class() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.stopped_listening = threading.Event()
            self.on_stop: Any = None
            self.ended = 0

        async def shutdown(self, sockets: Any = None) -> None:
            for server in self.servers:
                server.close()
            self.stopped_listening.set()
            if self.on_stop is not None:  # end the requests in flight, so their clients hear
                loop = asyncio.get_running_loop()
                self.ended = await loop.run_in_executor(None, self.on_stop)
            await super().shutdown(sockets)

    return Server


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
    api_key: str | None = None,
    allowed_origins: list[str] | None = None,
    root_path: str = "",
    disable_log_requests: bool = False,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    enable_tokenizer_info_endpoint: bool = False,
    trust_request_chat_template: bool = False,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
) -> ApiServer:
    """The server of ``llm``; clients name the model ``model_name`` (default: the model's path,
    or ``SmolLM2-135M-Instruct.Q4_1`` for the default model, as the CLI does).
    ``tool_call_parser`` names the parser that reads ``tool_choice: "auto"`` calls, which
    ``enable_auto_tool_choice`` allows (vLLM's two flags); ``reasoning_parser`` splits chat
    answers' reasoning off (it is checked against the model's vocabulary now). Unknown names are a
    KeyError. ``enable_prompt_tokens_details`` adds the prompt tokens found in the prefix cache to
    each answer's usage (vLLM's flag). The other settings are the CLI flags of the same names."""
    from llmhal.entrypoints.api_server import ServerState, build_app

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
    state.api_key = api_key
    state.log_requests = not disable_log_requests
    state.max_request_bytes = max_request_bytes
    state.tokenizer_info = enable_tokenizer_info_endpoint
    state.trust_request_chat_template = trust_request_chat_template
    app = build_app(state, allowed_origins=allowed_origins)
    try:
        return ApiServer(app, state, host, port, max_connections, root_path)
    except OSError:
        state.loop.shutdown()
        raise


def freeze_startup_heap() -> None:
    """Move everything alive once the server is built (model, tokenizer, app: ~260k objects for
    the default model) out of the collector's reach, as vLLM does after start-up: a full
    (generation-2) collection walked them all, measured 0.47-0.49 s on 2 busy vCPUs, during which
    no stream got a token; after the freeze one takes well under a millisecond. Only the serving
    process does this: a test that builds servers one after another would never get their memory
    back."""
    gc.collect()
    gc.freeze()


def _default_name(model_path: str) -> str:
    from llmhal.default_model import FILENAME

    return FILENAME.removesuffix(".gguf") if model_path.endswith(FILENAME) else model_path


def shutdown_server(server: ApiServer, grace_s: float = SHUTDOWN_GRACE_S) -> int:
    """Stop listening, end the requests in flight (their clients get a 503, or an error event and
    ``[DONE]`` on a stream), and wait up to ``grace_s`` for those answers to be written. Returns
    how many requests were ended."""
    server.shutdown()
    ended = server.ended + server.state.loop.shutdown()
    server._done.wait(grace_s)
    server.server_close()
    server.state.workers.shutdown(wait=False)
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
    p.add_argument(
        "--api-key",
        default=os.environ.get("VLLM_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $VLLM_API_KEY; /health, "
        "/metrics and the other routes stay open, as in vLLM)",
    )
    p.add_argument(
        "--allowed-origins",
        type=json.loads,
        default=["*"],
        help='CORS: origins allowed to call the server, a JSON list (default ["*"], as vLLM)',
    )
    p.add_argument(
        "--root-path",
        default="",
        help="the path prefix a proxy serves this under (and strips before forwarding)",
    )
    p.add_argument(
        "--disable-log-requests", action="store_true", help="do not log each request's line"
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help=f"larger request bodies are a 413 (default {DEFAULT_MAX_REQUEST_BYTES >> 20} MiB)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        help=f"connections and requests in progress at most; past it a 503 (default {DEFAULT_MAX_CONNECTIONS})",
    )
    p.add_argument(
        "--enable-tokenizer-info-endpoint",
        action="store_true",
        help="serve GET /tokenizer_info (the tokenizer's class, settings and chat template)",
    )
    p.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let requests send their own chat_template (a template is code the server runs)",
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
    if a.distributed_executor_backend == "external_launcher":
        # Every torchrun rank would run its own server on the same port (vLLM's offline-only
        # backend too).
        print(
            "llmhal serve: --distributed-executor-backend external_launcher is for offline use "
            "(LLM under torchrun); serve with mp or ray",
            file=sys.stderr,
        )
        return 2
    apply_serving_defaults(a)
    llm = build_llm("llmhal serve", a, max_num_seqs=a.max_num_seqs)
    if llm is None:
        return 2
    try:
        return _serve(llm, a)
    finally:
        # As `llmhal generate` does: a multi-process engine's ranks are stopped here, while the
        # interpreter is whole, not by finalizers at its exit.
        llm.shutdown()


def _serve(llm: Any, a: argparse.Namespace) -> int:
    """Build the server on the loaded ``llm`` and serve until stopped; the exit code."""
    from llmhal.engine.graph_warmup import record_serving_steps

    record_serving_steps(llm.engine, min(a.max_num_seqs, SERVE_GRAPH_WARMUP_DECODES))
    try:
        server = build_server(
            llm, a.host, a.port, a.served_model_name or a.model,
            tool_call_parser=a.tool_call_parser, enable_auto_tool_choice=a.enable_auto_tool_choice,
            reasoning_parser=a.reasoning_parser, enable_prompt_tokens_details=a.enable_prompt_tokens_details,
            api_key=a.api_key, allowed_origins=a.allowed_origins, root_path=a.root_path,
            disable_log_requests=a.disable_log_requests, max_request_bytes=a.max_request_bytes,
            enable_tokenizer_info_endpoint=a.enable_tokenizer_info_endpoint,
            trust_request_chat_template=a.trust_request_chat_template,
            max_connections=a.max_connections,
        )  # fmt: skip
    except (ValueError, RuntimeError) as e:  # a reasoning parser whose tags the model lacks
        print(f"llmhal serve: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # taken between the check and now
        print(f"llmhal serve: cannot listen on {a.host}:{a.port}: {e}", file=sys.stderr)
        return 2
    freeze_startup_heap()  # before saying where it listens: a client may start at once
    print(
        f"llmhal serve: http://{a.host}:{server.server_address[1]}/v1 ({server.state.model_name})",
        file=sys.stderr,
    )
    # uvicorn catches SIGTERM and Ctrl-C, stops, then raises the signal again: as KeyboardInterrupt.
    signal.signal(signal.SIGTERM, _interrupt)
    failed: list[bool] = []

    def stop_on_failure() -> None:
        # A rank of a multi-process engine failed: the engine cannot run another step. The loop
        # ends the requests in flight with its error; stop serving, as SIGTERM does.
        failed.append(True)
        os.kill(os.getpid(), signal.SIGTERM)

    llm.engine.executor.register_failure_callback(stop_on_failure)
    try:
        server.serve_forever(end_requests_on_stop=True)
    except KeyboardInterrupt:
        pass
    finally:
        ended = shutdown_server(server)
        print(
            f"llmhal serve: stopped; {ended} request(s) in flight were ended unfinished",
            file=sys.stderr,
        )
    if failed:
        print(f"llmhal serve: {llm.engine.executor.failure}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
