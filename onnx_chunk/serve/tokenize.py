"""vLLM's /tokenize and /detokenize: the server's tokenizer and chat template over HTTP.

/tokenize takes {"prompt": str, "add_special_tokens": true} or {"messages": [...],
"add_generation_prompt": true, "tools": [...]} (with vLLM's "continue_final_message",
"chat_template" and "chat_template_kwargs"), each with an optional "return_token_strs"
(requests.py's `TokenizeRequest`), and answers {"count", "max_model_len", "tokens",
"token_strs"}: the ids a generation request with the same prompt is fed, by the server's own
`PromptEncoder` (its special-token policy; the messages, tools and template checked as chat
checks them). A prompt over the context is refused (400) before it is encoded, as a generation
request's is. /detokenize takes {"tokens": [ids]} (`DetokenizeRequest`) and answers
{"prompt": text}.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from onnx_chunk.errors import CapacityError
from onnx_chunk.serve.prompts import chat_options, rendered_ids
from onnx_chunk.serve.protocol import RequestError
from onnx_chunk.serve.requests import DetokenizeRequest, TokenizeRequest

if TYPE_CHECKING:
    from onnx_chunk.text.prompt import PromptEncoder
    from onnx_chunk.text.tokenizer import Tokenizer


def tokenize(body: object, prompts: PromptEncoder,
             check_model: Callable[[object], None]) -> dict[str, Any]:
    """The answer of /tokenize (see the module docstring); `prompts`: the server's encoder,
    bounded by its context."""
    request = TokenizeRequest.parse(body)
    check_model(request.model)
    messages = request.template_messages()
    try:
        if messages is not None:
            ids = rendered_ids(messages, request.template_tools(),
                               chat_options(request.chat, prompts.tokenizer), prompts, None)
        else:
            assert request.prompt is not None  # the model requires one of them
            ids = prompts.encode(request.prompt, add_special_tokens=request.add_special_tokens)
    except CapacityError as error:
        raise RequestError(str(error), param="prompt" if messages is None else "messages",
                           code="context_length_exceeded") from error
    tokenizer = prompts.tokenizer
    strings = ([tokenizer.id_to_token(token) for token in ids]
               if request.return_token_strs else None)
    return {"count": len(ids), "max_model_len": prompts.max_tokens, "tokens": ids,
            "token_strs": strings}


def detokenize(body: object, tokenizer: Tokenizer,
               check_model: Callable[[object], None]) -> dict[str, Any]:
    """The answer of /detokenize: {"prompt": the text of "tokens"}."""
    request = DetokenizeRequest.parse(body, vocab_size=tokenizer.vocab_size)
    check_model(request.model)
    return {"prompt": tokenizer.decode(request.tokens)}
