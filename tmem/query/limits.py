"""Input limits shared by every HTTP endpoint of ``tmem serve`` (the API and the explorer's)."""

from __future__ import annotations

MAX_CONVERSATION_ID_CHARS = 1024
PRESET_PATTERN = r"^[a-z0-9_+-]{1,100}$"
MAX_BODY_BYTES = 64 * 1024
MAX_QUERY_CHARS = 4000
