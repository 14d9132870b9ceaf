"""The OpenAI-compatible API (/v1): chat completions, completions,
embeddings and the model list, over the same data plane as gRPC; and
vLLM's /tokenize and /detokenize beside it, in vLLM's shapes.

The endpoints live by noun: openai_chat.py (chat and completions, JSON and
server-sent events), openai_embeddings.py, and openai_fields.py for what
every /v1 endpoint shares (reading fields, OpenAI's error shape).
"""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from modeld.backends.errors import NotFound
from modeld.backends.generation.params import GenerateRequest
from modeld.backends.model_config import ToolParser
from modeld.server.dataplane import DataPlane
from modeld.server.http.common import unless_client_leaves
from modeld.server.http.openai_chat import answer_generation
from modeld.server.http.openai_embeddings import embeddings
from modeld.server.http.openai_fields import (
    FieldError, check_fields, error_response, get_bool, model_name, takes_json_body,
)
from modeld.server.http.openai_sampling import chat_template_kwargs
from modeld.server.http.openai_tools import chat_messages, tool_fields
from modeld.server.requests import ModelState, ModelStatus


# vLLM's chat form of /tokenize
_CHAT_TOKENIZE_FIELDS = {"model", "messages", "tools", "add_generation_prompt", "chat_template_kwargs",
                         "add_special_tokens", "prompt"}


def routes(plane: DataPlane) -> list[BaseRoute]:
    return OpenAIApi(plane).routes()


class OpenAIApi:
    def __init__(self, plane: DataPlane) -> None:
        # app.py's middleware refuses new requests while the daemon drains
        self.plane = plane
        self.started = int(time.time())  # what `created` says of every model: when this daemon began serving it

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.get_model, methods=["GET"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
        ]

    @takes_json_body
    async def tokenize(self, request: Request, body: dict) -> Response:
        model = model_name(body)
        if body.get("messages") is not None:
            tokens = await self._chat_prompt_ids(model, body)
        else:
            tokens = await self._prompt_ids(model, body)
        return JSONResponse({"tokens": tokens, "count": len(tokens),
                             "max_model_len": self.plane.context_length(model)})

    async def _prompt_ids(self, model: str, body: dict) -> list[int]:
        check_fields(body, {"model", "prompt", "add_special_tokens"}, "/tokenize")
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise FieldError("prompt", "prompt must be a string (or send messages)")
        if not get_bool(body, "add_special_tokens", True):
            raise FieldError("add_special_tokens", "add_special_tokens: false is not supported; the model's tokenizer "
                                                   "adds its special tokens (a BOS) as generation does")
        return await self.plane.tokenize(model, prompt) if prompt else []

    async def _chat_prompt_ids(self, model: str, body: dict) -> list[int]:
        """vLLM's chat form: the ids the model's chat template makes of these
        messages (and tools), exactly the prompt a chat completion runs on."""
        check_fields(body, _CHAT_TOKENIZE_FIELDS, "/tokenize")
        if body.get("prompt") is not None:
            raise FieldError("prompt", "send prompt or messages, not both")
        if get_bool(body, "add_special_tokens", False):
            raise FieldError("add_special_tokens", "add_special_tokens: true is not supported with messages; the "
                                                   "chat template writes the special tokens itself")
        kwargs = dict(chat_template_kwargs(body))
        if body.get("add_generation_prompt") is not None:
            if "add_generation_prompt" in kwargs:
                raise FieldError("add_generation_prompt", "add_generation_prompt is given here and in "
                                                          "chat_template_kwargs; send it once")
            kwargs["add_generation_prompt"] = get_bool(body, "add_generation_prompt", True)
        tools = tool_fields({"tools": body.get("tools")}, ToolParser.HERMES).tools
        generate = GenerateRequest(model, messages=chat_messages(body), tools=tools,
                                   chat_template_kwargs=tuple(kwargs.items()))
        generate.validate()
        return list(await self.plane.prompt_ids(generate))

    @takes_json_body
    async def detokenize(self, request: Request, body: dict) -> Response:
        model = model_name(body)
        check_fields(body, {"model", "tokens"}, "/detokenize")
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in tokens):
            raise FieldError("tokens", "tokens must be an array of token ids (non-negative integers)")
        return JSONResponse({"prompt": await self.plane.detokenize(model, tokens) if tokens else ""})

    @takes_json_body
    async def chat_completions(self, request: Request, body: dict) -> Response:
        return await answer_generation(self.plane, request, body, chat=True)

    @takes_json_body
    async def completions(self, request: Request, body: dict) -> Response:
        return await answer_generation(self.plane, request, body, chat=False)

    @takes_json_body
    async def embeddings(self, request: Request, body: dict) -> Response:
        # a client that leaves cancels every chunk still queued or running
        return JSONResponse(await unless_client_leaves(request, embeddings(self.plane, body)))

    async def list_models(self, request: Request) -> Response:
        try:
            return JSONResponse({"object": "list", "data": [self._describe(s) for s in self.plane.statuses()]})
        except Exception as exc:  # noqa: BLE001 - every failure answers in OpenAI's shape
            return error_response(exc, self.plane, "")

    async def get_model(self, request: Request) -> Response:
        name = request.path_params["model"]
        try:
            status = self.plane.find_status(name)
            if status is None:
                raise NotFound(f"model {name!r} is not in the repository; GET /v1/models lists the models")
            return JSONResponse(self._describe(status))
        except Exception as exc:  # noqa: BLE001
            return error_response(exc, self.plane, name)

    def _describe(self, status: ModelStatus) -> dict:
        base = status.base  # a LoRA adapter's base model: vLLM's `parent`
        return {"id": status.name, "object": "model", "created": self.started, "owned_by": "modeld",
                "ready": status.state is ModelState.READY, "state": status.state.value,
                **({"parent": base} if base else {}), **({"reason": status.reason} if status.reason else {})}
