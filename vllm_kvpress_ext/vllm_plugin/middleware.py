"""The plugin's HTTP layer on vLLM's API server: request policy fields in, KV figures out.

- In: the embedded server's top-level `"kv_policy"` body field is moved into `vllm_xargs` (vLLM
  would ignore it), merged with any `vllm_xargs.kv_*` fields by the embedded server's `policy_spec`;
  two policies that disagree are an OpenAI-shaped 400.
- Out: a non-streaming completion or chat response carries the worker's KV figures as
  `kv_transfer_params.kvpress`; they are moved into `usage` (`kv_policy`, `kv_bytes`,
  `kv_bytes_peak`, `kv_retention`, `kv_tokens_kept`), the same fields the embedded server reports.
  Streams get them in their final usage chunk (`usage.py`, which also sums batched prompts and n
  samples).
- A chat that names no context gets its default one: the messages before its last user message
  (`chat_context.py`), compressed alone and reused by every later question about them.
- A body that is not JSON goes to vLLM as sent, which answers it with its own 400; one nested too
  deeply for Python's parser (where vLLM's parse would fail the same way) is an OpenAI-shaped 400 here.

Installed by the general plugin around vLLM's `build_app`, so nothing needs configuring (vLLM's
`vllm.endpoint_plugins` group is not used: it loads only when `VLLM_PLUGINS` names it, and warns
otherwise). The same hook registers the `kvpress_*` metrics collector on the API process's registry.
"""

from __future__ import annotations

import json
import multiprocessing
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from vllm_kvpress_ext.api import KV_PREFIX
from vllm_kvpress_ext.api.errors import APIError, unsupported
from vllm_kvpress_ext.api.policy_spec import policy_fields, policy_spec
from vllm_kvpress_ext.vllm_plugin.chat_context import name_default_context
from vllm_kvpress_ext.vllm_plugin.contexts import CONTEXT_FIELD
from vllm_kvpress_ext.vllm_plugin.metrics import choose_metrics_file, multiprocess_exposition, register_collector
from vllm_kvpress_ext.vllm_plugin.patches import wrap
from vllm_kvpress_ext.vllm_plugin.usage import install_usage_hooks, usage_fields

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

PATHS = ("/v1/completions", "/v1/chat/completions")


# `kvpress serve` names a chat's context by its messages too; vLLM renders the chat after this layer, so the
# plugin cannot count their tokens here. vLLM would drop the field unread and answer 200 as if the request had
# not asked: a 400 until the plugin serves it.
REFUSED_CONTEXT_FIELDS = ("kv_prefix_messages",)


#: The top-level `kv_*` fields a request may carry: the policy, the context, and vLLM's own transfer parameters.
KNOWN_KV_FIELDS = ("kv_policy", CONTEXT_FIELD, "kv_transfer_params", *REFUSED_CONTEXT_FIELDS)


def rewrite_request(payload: dict[str, Any]) -> dict[str, Any]:
    """Fold a top-level `kv_policy` and `kv_prefix_tokens` into `vllm_xargs` (raises `APIError` when they disagree
    or are invalid), and refuse the context fields the plugin does not serve."""
    for field in REFUSED_CONTEXT_FIELDS:
        if field in payload:
            raise unsupported(
                field,
                "naming a context by its messages is served by `kvpress serve`; the plugin takes kv_prefix_tokens",
            )
    # vLLM ignores fields it does not know; in this project's namespace that would hide a misspelt policy field.
    unknown = [key for key in payload if key.startswith(KV_PREFIX) and key not in KNOWN_KV_FIELDS]
    if unknown:
        raise APIError(400, f"unrecognized request argument supplied: {unknown[0]}", param=unknown[0])
    # vLLM accepts best_of and serves n samples as if it were not there; `kvpress serve` refuses it too.
    if payload.get("best_of") not in (None, 1):
        raise unsupported("best_of", "only best_of=1 is supported")
    if "kv_policy" not in payload and CONTEXT_FIELD not in payload:
        return payload
    raw_xargs = payload.get("vllm_xargs")
    if raw_xargs is not None and not isinstance(raw_xargs, dict):
        raise APIError(400, f"vllm_xargs must be an object, got {type(raw_xargs).__name__}", param="vllm_xargs")
    xargs = dict(raw_xargs or {})
    if CONTEXT_FIELD in payload:
        boundary = payload.pop(CONTEXT_FIELD)
        if CONTEXT_FIELD in xargs and xargs[CONTEXT_FIELD] != boundary:
            raise APIError(
                400, f"{CONTEXT_FIELD} and vllm_xargs.{CONTEXT_FIELD} disagree; send one", param=CONTEXT_FIELD
            )
        if boundary is not None:  # null: no context, as `kvpress serve` reads it
            xargs[CONTEXT_FIELD] = boundary
    if "kv_policy" in payload:
        _fold_policy(payload.pop("kv_policy"), xargs)
    payload["vllm_xargs"] = xargs
    return payload


def _fold_policy(body_policy: Any, xargs: dict[str, Any]) -> None:
    """The body's `kv_policy` merged with the `vllm_xargs.kv_*` policy fields into `xargs["kv_policy"]`."""
    kv_fields = policy_fields(xargs)
    if kv_fields and "kv_policy" not in kv_fields:
        # Flat `kv_<param>` fields refine the body's policy.
        body_spec = policy_spec(body_policy, None)
        named = body_spec if isinstance(body_spec, str) or body_spec is None else json.dumps(body_spec)
        spec = policy_spec(None, {**kv_fields, "kv_policy": named})
    else:
        spec = policy_spec(body_policy, kv_fields or None)
    for key in kv_fields:
        del xargs[key]
    if spec is not None:
        xargs["kv_policy"] = spec if isinstance(spec, str) else json.dumps(spec)


def rewrite_response(payload: dict[str, Any]) -> dict[str, Any]:
    params = payload.get("kv_transfer_params")
    if not isinstance(params, dict) or "kvpress" not in params:
        return payload
    figures = params.pop("kvpress")
    if not params:
        payload.pop("kv_transfer_params")
    usage = payload.get("usage")
    if isinstance(usage, dict):
        usage.update(usage_fields(figures))
    return payload


async def _send_error(send: Send, exc: APIError) -> None:
    error = json.dumps(exc.body()).encode()
    headers = _with_length([(b"content-type", b"application/json")], len(error))
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": error})


async def _send_metrics(send: Send, exposition: bytes) -> None:
    from prometheus_client import CONTENT_TYPE_LATEST

    headers = _with_length([(b"content-type", CONTENT_TYPE_LATEST.encode())], len(exposition))
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": exposition})


def _with_length(headers: list[tuple[bytes, bytes]], length: int) -> list[tuple[bytes, bytes]]:
    kept = [(k, v) for k, v in headers if k.lower() != b"content-length"]
    return [*kept, (b"content-length", str(length).encode())]


class KVPressMiddleware:
    """Pure ASGI middleware (streaming responses pass through untouched)."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") == "http" and scope.get("method") == "GET" and scope.get("path") == "/metrics":
            exposition = multiprocess_exposition()
            if exposition is not None:  # several API server processes: vLLM's handler would leave kvpress_* out
                await _send_metrics(send, exposition)
                return
        if scope.get("type") != "http" or scope.get("method") != "POST" or scope.get("path") not in PATHS:
            await self.app(scope, receive, send)
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        try:
            try:
                payload = json.loads(body)
            except ValueError:
                payload = None  # not JSON: vLLM gets the body as sent and answers it with its own 400
            if isinstance(payload, dict):
                payload = rewrite_request(payload)
                if scope.get("path") == "/v1/chat/completions" and scope.get("app") is not None:
                    await name_default_context(scope["app"].state, payload)
                body = json.dumps(payload).encode()
        except RecursionError:
            # Nested deeper than Python's parser goes (vLLM's own parse would fail the same way); also a
            # body parsed right at the limit that cannot be re-encoded, whose `kv_policy` must not be lost.
            await _send_error(send, APIError(400, "malformed JSON body: nested too deeply"))
            return
        except APIError as exc:
            await _send_error(send, exc)
            return
        if isinstance(payload, dict):
            scope = dict(scope)
            scope["headers"] = _with_length(list(scope.get("headers", [])), len(body))
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        if not isinstance(payload, dict) or payload.get("stream"):
            await self.app(scope, replay, send)
            return
        await self.app(scope, replay, _BufferedJSON(send))


class _BufferedJSON:
    """Collects a JSON response, rewrites it, then sends it with a corrected length."""

    def __init__(self, send: Send) -> None:
        self.send = send
        self.start: Message | None = None
        self.chunks: list[bytes] = []

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.start = dict(message)
            return
        if message["type"] != "http.response.body" or self.start is None:
            await self.send(message)
            return
        self.chunks.append(message.get("body", b""))
        if message.get("more_body", False):
            return
        body = b"".join(self.chunks)
        try:
            payload = json.loads(body)
            if isinstance(payload, dict):
                body = json.dumps(rewrite_response(payload)).encode()
        except ValueError:
            pass
        start = self.start
        start["headers"] = _with_length(list(start.get("headers", [])), len(body))
        await self.send(start)
        await self.send({"type": "http.response.body", "body": body})


def attach(app: Any) -> None:
    """Add the middleware and the metrics collector to a vLLM API app, once."""
    if getattr(app.state, "kvpress_attached", False):
        return
    app.state.kvpress_attached = True
    # Outermost, around whatever stack the app has or will build (vLLM may build it before we get here,
    # after which Starlette refuses `add_middleware`).
    build_stack = app.build_middleware_stack
    app.build_middleware_stack = lambda: KVPressMiddleware(build_stack())
    if app.middleware_stack is not None:
        app.middleware_stack = KVPressMiddleware(app.middleware_stack)
    register_collector()


# The name vLLM gives the API server processes it starts (`ApiServer_0`, ...; vllm.v1.utils.APIServerProcessManager).
API_SERVER_PROCESS = "ApiServer_"


def install_into_api_server() -> None:
    """Wrap vLLM's `build_app` in a process that serves HTTP: the top-level one (`vllm serve`, or a script using
    `vllm.LLM`), or one of the API server processes `vllm serve` starts when it runs several (`--api-server-count`,
    which data parallelism raises to the replicas' count).

    vLLM's engine-core and worker processes are started through `multiprocessing` too; they skip this. The
    top-level process also picks the metrics snapshot path every process it starts inherits.
    """
    if multiprocessing.parent_process() is None:
        choose_metrics_file()
    elif not multiprocessing.current_process().name.startswith(API_SERVER_PROCESS):
        return
    install_usage_hooks()
    try:
        from vllm.entrypoints.launchers.api_server import entry
    except ImportError:  # pragma: no cover - vLLM without its API server
        return

    def wrap_build_app(original: Any) -> Any:
        def build_app(*args: Any, **kwargs: Any) -> Any:
            app = original(*args, **kwargs)
            attach(app)
            return app

        return build_app

    wrap(entry, "build_app", wrap_build_app, "middleware")
