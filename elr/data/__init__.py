"""What training reads: token stores, weighted mixtures of them, windows and document ids (docs/data.md).

Below training and beside the models (neither imports the other): a store answers its token count, the
tokens in [a, b) and the document starts in [a, b) by arithmetic on a small index (sources.py and the
formats it opens); a mixture maps global sample g to (source, sample within it) (mixture.py); the loader
cuts windows of seq_len + 1 tokens and their document ids and keeps one integer of state (loader.py).
"""
