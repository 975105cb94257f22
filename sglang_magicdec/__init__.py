"""sglang-magicdec: MagicDec self-speculative decoding for long-context serving, inside SGLang."""

__version__ = "0.1.0"
