"""moaspec: speculative decoding with a Mixture-of-Attentions drafter."""
__version__ = "0.1.0"
