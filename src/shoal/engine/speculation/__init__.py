"""Speculative decoding: guess a request's next tokens cheaply, verify them in one pass.

config.py parses `--speculative MODEL=ngram[:K]`; ngram.py guesses from the request's own
text; length.py adapts how many to guess; verify.py keeps the verified prefix; speculator.py
ties them to the engine's step.
"""
