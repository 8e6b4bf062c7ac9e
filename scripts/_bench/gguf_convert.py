"""llama.cpp's convert_hf_to_gguf.py on a benchmark checkpoint (run with the exporters venv).

`python gguf_convert.py TREE PRE_TOKENIZER CHECKPOINT CONVERTER_ARGS...`: TREE holds the
converter and its gguf-py as llama.cpp ships them. The converter names a BPE tokenizer's
pre-tokenizer by hashing how it splits a probe text, and refuses a hash it does not know; the
benchmark checkpoints carry a small tokenizer trained here (their prompts are token ids, and
tokens are not compared across runtimes), so the name the real model's tokenizer gets
(PRE_TOKENIZER, e.g. "qwen2") is given instead. Everything else is the converter's own work.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> None:
    tree, pre_tokenizer, checkpoint, *converter_args = sys.argv[1:]
    sys.path[:0] = [str(Path(tree) / "gguf-py"), tree]
    import convert_hf_to_gguf
    from conversion.base import TextModel

    TextModel.get_vocab_base_pre = lambda self, tokenizer: pre_tokenizer
    sys.argv = ["convert_hf_to_gguf.py", checkpoint, *converter_args]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
