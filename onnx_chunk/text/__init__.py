"""Text in, text out: the model folder's tokenizer, its chat template, streamed detokenization,
stop strings, and the generation that puts them around a sequence's token loop."""
