"""Text in, text out: the model folder's tokenizer, its chat template, the one prompt encoder
(`prompt.PromptEncoder`), streamed detokenization, stop strings, and the generation that puts
them around the engine's requests."""
