"""A thinking block's signature, as ladle writes and reads it. Anthropic's signature is opaque to the client, which
sends it back verbatim; Anthropic uses it to restore thinking the client was never shown. ladle does the same for
`thinking.display: "omitted"`: the block goes out with empty text and the reasoning sealed in its signature, so the
next turn renders that reasoning exactly as if it had been shown (a chat template keeps it within a tool loop), and
the prefix cache still matches. A shown block's signature is a plain marker."""
from __future__ import annotations

import base64
import binascii

SHOWN = "ladle"
_SEALED = "ladle.r1."


def seal(reasoning: str) -> str:
    """The signature of an omitted block: its reasoning, recoverable by unseal."""
    return _SEALED + base64.urlsafe_b64encode(reasoning.encode()).decode()


def unseal(thinking: str, signature: str | None) -> str:
    """A thinking block's reasoning as the client sent it back: its own text, or what an omitted block's signature
    carries. A signature that claims to carry reasoning and does not decode is the client's error, named."""
    if thinking or not signature or not signature.startswith(_SEALED):
        return thinking
    try:
        return base64.b64decode(signature[len(_SEALED):].encode(), altchars=b"-_", validate=True).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"a thinking block's signature is not one ladle wrote ({e}); send the block back as it "
                         "was received") from None
