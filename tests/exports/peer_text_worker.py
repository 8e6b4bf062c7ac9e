"""Run in the peer venv: what transformers and onnxruntime-genai make of an export's text.

argv[1] is a JSON object: folder, texts, chats ([{"messages", "add_generation_prompt"}]),
prompt (a text to generate from greedily), new_tokens and max_length. Prints one JSON object:
transformers' encode of each text and chat-template rendering of each chat; genai's
Tokenizer.encode of each text; genai's greedy tokens for the prompt and their decoding
(tokens the model emits after the prompt; genai's own search, stopping at its EOS), and
transformers' decoding of those tokens (skip_special_tokens=True).
"""

import json
import sys

import numpy as np
import onnxruntime_genai as og
from transformers import AutoTokenizer


def main() -> None:
    request = json.loads(sys.argv[1])
    folder = request["folder"]
    hf = AutoTokenizer.from_pretrained(folder)
    chats = [hf.apply_chat_template(chat["messages"], tokenize=False,
                                    add_generation_prompt=chat["add_generation_prompt"])
             for chat in request["chats"]] if hf.chat_template else []
    config = og.Config(folder)
    config.clear_providers()
    model = og.Model(config)
    tokenizer = og.Tokenizer(model)
    prompt = tokenizer.encode(request["prompt"])
    params = og.GeneratorParams(model)
    # genai 0.18 refuses a sliding-window export whose max_length is under the window.
    params.set_search_options(max_length=request["max_length"], do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([prompt], dtype=np.int32))
    tokens = []
    while not generator.is_done() and len(tokens) < request["new_tokens"]:
        generator.generate_next_token()
        tokens.append(int(generator.get_next_tokens()[0]))
    print(json.dumps({
        "transformers": {"texts": [hf.encode(text) for text in request["texts"]],
                         "chats": chats,
                         "decoded": hf.decode(tokens, skip_special_tokens=True)},
        "genai": {"texts": [tokenizer.encode(text).tolist() for text in request["texts"]],
                  "prompt": prompt.tolist(), "tokens": tokens,
                  "text": tokenizer.decode(np.array(tokens, dtype=np.int32))},
    }))


if __name__ == "__main__":
    main()
