"""Speculative decoding: proposers that guess the next tokens of a request, cheaply.

`proposer.py` picks one from the config; `ngram_proposer.py` looks the guess up in the
sequence itself, `draft_model_proposer.py` asks a smaller model. The target model checks the
guesses in one forward (`engine/model_runner.py`) and `layers/rejection_sampler.py` keeps
the accepted prefix.
"""
