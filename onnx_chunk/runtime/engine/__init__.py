"""The engine: requests, their scheduling onto slots, the generation loop and lone sequences."""
