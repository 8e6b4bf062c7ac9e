"""The runtime's bottom layer: plain descriptions every other layer reads (the decoder's
ports); it imports no other part of the runtime."""
