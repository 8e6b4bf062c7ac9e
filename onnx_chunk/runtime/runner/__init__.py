"""The model runner: every forward of a dynamic decoder, its masks and padding."""
