"""Run in the peer venv: transformers' tokenizer of a folder on the cases of a JSON file.

argv: CASES_JSON FOLDER... Cases: {"chats": [{"messages", "add_generation_prompt"}...],
"texts": [str...]}. Prints, per folder in order, {"chats": [{"text"} or {"error"}...],
"texts": [[ids]...], "decoded": [str...], "class", "eos_token_id", "bos_token_id"}.
"""

import json
import sys

from transformers import AutoTokenizer


def run(folder: str, cases: dict) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    chats = []
    for case in cases["chats"]:
        try:
            text = tokenizer.apply_chat_template(
                case["messages"], tokenize=False,
                add_generation_prompt=case["add_generation_prompt"])
        except Exception as error:  # the template's raise_exception, reported as data
            chats.append({"error": str(error)})
        else:
            chats.append({"text": text})
    texts = [tokenizer.encode(text) for text in cases["texts"]]
    decoded = [tokenizer.decode(ids, skip_special_tokens=True) for ids in texts]
    return {"chats": chats, "texts": texts, "decoded": decoded,
            "class": type(tokenizer).__name__, "eos_token_id": tokenizer.eos_token_id,
            "bos_token_id": tokenizer.bos_token_id}


def main(cases_path: str, *folders: str) -> None:
    with open(cases_path, encoding="utf-8") as handle:
        cases = json.load(handle)
    print(json.dumps([run(folder, cases) for folder in folders]))


if __name__ == "__main__":
    main(*sys.argv[1:])
