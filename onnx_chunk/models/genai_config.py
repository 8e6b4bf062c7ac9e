"""The `genai_config.json` that lets onnxruntime-genai load a reference decoder's folder."""

from __future__ import annotations

from onnx_chunk.models.config import DecoderConfig
from onnx_chunk.models.variants import VariantSpec

MODEL_FILENAME = "model.onnx"
# The inputs_embeds variant writes its embedding table here ([vocab, hidden] float32), so a
# runtime can embed the tokens it generates.
EMBEDDINGS_FILENAME = "embeddings.npy"


def genai_config(config: DecoderConfig, spec: VariantSpec, dtype: str = "float32") -> dict:
    """The config the onnxruntime-genai model builder would write for this decoder.

    A float16 decoder is what the builder exports for CUDA (`-p fp16 -e cuda`), and its
    config then asks for the CUDA provider; a float32 one is its CPU export, with none.
    """
    provider_options: list[dict[str, dict]] = [{"cuda": {}}] if dtype == "float16" else []
    inputs = {"inputs_embeds" if spec.inputs_embeds else "input_ids":
              "inputs_embeds" if spec.inputs_embeds else "input_ids",
              "attention_mask": "attention_mask"}
    if spec.position_ids:
        inputs["position_ids"] = "position_ids"
    inputs["past_key_names"] = "past_key_values.%d.key"
    inputs["past_value_names"] = "past_key_values.%d.value"
    outputs = {"logits": "logits", "present_key_names": "present.%d.key",
               "present_value_names": "present.%d.value"}
    decoder = {
        "session_options": {"log_id": "onnxruntime-genai", "provider_options": provider_options},
        "filename": MODEL_FILENAME,
        "head_size": config.head_size,
        "hidden_size": config.hidden_size,
        "inputs": inputs,
        "outputs": outputs,
        "num_attention_heads": config.num_heads,
        "num_hidden_layers": config.num_layers,
        "num_key_value_heads": config.num_kv_heads,
    }
    model_type = "llama"
    if config.conv_layers:
        model_type = "lfm2"
        inputs["past_conv_names"] = "past.%d.conv"
        outputs["present_conv_names"] = "present.%d.conv"
        decoder["layer_types"] = ["conv" if layer in config.conv_layers else "full_attention"
                                  for layer in range(config.num_layers)]
        decoder["conv_cache_size"] = config.conv_kernel - 1
    return {
        "model": {
            "bos_token_id": config.bos_token_id,
            "context_length": config.max_positions,
            "decoder": decoder,
            "eos_token_id": config.eos_token_id,
            "pad_token_id": config.pad_token_id,
            "type": model_type,
            "vocab_size": config.vocab_size,
        },
        "search": {
            "diversity_penalty": 0.0,
            "do_sample": False,
            "early_stopping": True,
            "length_penalty": 1.0,
            "max_length": config.max_positions,
            "min_length": 0,
            "no_repeat_ngram_size": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            "past_present_share_buffer": True,
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_k": 1,
            "top_p": 1.0,
        },
    }
