"""The model runner: every forward of a dynamic decoder, its ports, masks, padding and
logits rows."""
