"""Structured output: decoding constrained to a JSON schema by a grammar library (llguidance).

`json_constraint(tokenizer, schema, vocab_size)` compiles a schema into a `GrammarConstraint`
(a `Sampling.constraint`); each request's `Sampler` gets its own matcher from it, which masks
the tokens the grammar forbids before every choice. Needs the `[structured]` extra.
"""

from onnx_chunk.structured.constraint import GrammarConstraint, json_constraint, prepare

__all__ = ["GrammarConstraint", "json_constraint", "prepare"]
