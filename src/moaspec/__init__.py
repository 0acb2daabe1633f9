"""moaspec: speculative decoding with a Mixture-of-Attentions drafter."""
from moaspec.threads import configure_openmp

configure_openmp()  # before torch starts its OpenMP runtime: waiting threads sleep instead of spinning
__version__ = "0.1.0"
