"""Draft KV-selection policies: which committed positions the draft attends to."""

from sglang_magicdec.drafts.snapkv import SnapKVDraft
from sglang_magicdec.drafts.streaming import StreamingDraft

__all__ = ["SnapKVDraft", "StreamingDraft"]
