"""The peer benchmark's modules; bench/peers/run.py is its entry point."""
