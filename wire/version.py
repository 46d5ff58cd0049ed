"""The wire protocol's version, apart from the messages (wire/messages.py, where the rule for
mixing versions is) so that `fedsilo --version` names it without loading torch."""

from __future__ import annotations

PROTOCOL_VERSION = 7
