"""llama.cpp's convert_hf_to_gguf.py on a benchmark checkpoint (run with the exporters venv).

`python gguf_convert.py TREE PRE_TOKENIZER CHECKPOINT CONVERTER_ARGS...`: TREE holds the
converter and its gguf-py as llama.cpp ships them. The converter names a BPE tokenizer's
pre-tokenizer by hashing how it splits a probe text, and refuses a hash it does not know; the
benchmark checkpoints carry a small tokenizer trained here (their prompts are token ids, and
tokens are not compared across runtimes), so the name the real model's tokenizer gets
(PRE_TOKENIZER, e.g. "qwen2") is given instead. The converter's qwen2 and llama vocab readers
try sentencepiece first and fall back to BPE on the FileNotFoundError of a missing
tokenizer.model, but import sentencepiece before looking for the file; without a tokenizer.model
that error is raised before the import, so the venv needs no sentencepiece. Everything else is
the converter's own work.
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
    sentencepiece_vocab = TextModel._create_vocab_sentencepiece

    def create_vocab_sentencepiece(self):
        if not (self.dir_model / "tokenizer.model").is_file():
            raise FileNotFoundError(f"File not found: {self.dir_model / 'tokenizer.model'}")
        return sentencepiece_vocab(self)

    TextModel._create_vocab_sentencepiece = create_vocab_sentencepiece
    sys.argv = ["convert_hf_to_gguf.py", checkpoint, *converter_args]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
