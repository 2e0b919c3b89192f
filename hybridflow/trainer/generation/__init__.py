"""The gen stage as a type, one class per generation mode (source.py has the protocol and the table)."""

from hybridflow.trainer.generation.factory import make_generation
from hybridflow.trainer.generation.source import Generated, GenerationSource

__all__ = ["GenerationSource", "Generated", "make_generation"]
